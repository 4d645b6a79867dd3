/* A probe, not a kernel of the engine: one row × 4-bit weights in an "outputs in lanes"
 * layout, AVX-512 VNNI, to measure what such a layout would give decode
 * (benchmarks/scripts/decode_layout_probe.py). It reuses the engine kernel's activation
 * quantization (quantize_row) by including qmatmul.c.
 *
 * Layout per group of 16 outputs and block of 32 inputs: 4 × 64 bytes, each 16 outputs × 4
 * bytes, input step 2j in the low nibbles and 2j + 1 in the high ones; sc int16 [16], mins fp16
 * [16]; dsup float [16] per super-block. The same bytes per weight as the engine's 4-bit
 * layout. One vpdpbusd multiplies 64 weights (4 inputs × 16 outputs) by 4 broadcast activation
 * bytes, so a block costs ~40 instructions per 512 weights, against ~140 for the engine's
 * decode loop (pmaddubsw/vpdpwssd per output, a horizontal sum per super-block and output). */
#include "../../specserve/kernels/qmatmul.c"

int probe_matmul1(const float *x, int64_t k, int64_t sb, const uint8_t *w, const int16_t *sc,
                  const uint16_t *mins, const float *dsup, int64_t n, float *y) {
    const int64_t nb = k / QK, ns = k / sb, per = sb / QK, groups = n / 16;
    int8_t *qa = aligned_alloc(64, (size_t)k + 64);
    float *da = malloc(sizeof(float) * (size_t)ns), *dsa = malloc(sizeof(float) * (size_t)nb);
    if (!qa || !da || !dsa) return -1;
    quantize_row(x, k, sb, qa, da, dsa);
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < groups; gi++) {
        const uint8_t *wg = w + gi * nb * 256;
        const int16_t *sg = sc + gi * nb * 16;
        const uint16_t *mg = mins + gi * nb * 16;
        const float *dg = dsup + gi * ns * 16;
        const __m512i mask = _mm512_set1_epi8(0x0F);
        __m512 main = _mm512_setzero_ps(), m = _mm512_setzero_ps();
        for (int64_t s = 0; s < ns; s++) {
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int64_t b = s * per; b < (s + 1) * per; b++) {
                const uint8_t *wb = wg + b * 256;
                for (int j = 0; j < 4; j++)
                    _mm_prefetch((const char *)wb + 2048 + 64 * j, _MM_HINT_T0);
                const int8_t *ab = qa + b * QK;
                __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    int32_t a0, a1;
                    memcpy(&a0, ab + 8 * j, 4);
                    memcpy(&a1, ab + 8 * j + 4, 4);
                    const __m512i packed = _mm512_loadu_si512((const void *)(wb + 64 * j));
                    const __m512i w0 = _mm512_and_si512(packed, mask);
                    const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
                    t0 = _mm512_dpbusd_epi32(t0, w0, _mm512_set1_epi32(a0));
                    t1 = _mm512_dpbusd_epi32(t1, w1, _mm512_set1_epi32(a1));
                }
                const __m512i scale =
                    _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(sg + b * 16)));
                const __m512i prod = _mm512_mullo_epi32(_mm512_add_epi32(t0, t1), scale);
                lo = _mm512_add_epi64(lo, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(prod)));
                hi = _mm512_add_epi64(hi, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(prod, 1)));
                m = _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + b * 16))),
                    _mm512_set1_ps(dsa[b]), m);
            }
            const __m512 isum = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(lo)),
                                                   _mm512_cvtepi64_ps(hi), 1);
            main = _mm512_fmadd_ps(
                isum, _mm512_mul_ps(_mm512_loadu_ps(dg + s * 16), _mm512_set1_ps(da[s])), main);
        }
        _mm512_storeu_ps(y + gi * 16, _mm512_add_ps(main, m));
    }
    free(qa), free(da), free(dsa);
    return 0;
}
