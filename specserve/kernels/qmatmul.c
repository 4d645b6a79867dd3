/* 4- and 8-bit weight × 8-bit activation matrix multiply for x86-64 CPUs with AVX2, FMA and
 * F16C.
 *
 * Weights W [n, k], per output row, in blocks of 32 inputs grouped into super-blocks of `sb`
 * inputs (64, 128 or 256; k a multiple of sb):
 *   qs    4 bits: [n, k/64, 32] uint8: 32 bytes hold block 2p in their low and block 2p + 1
 *         in their high nibbles (q in 0..15), so one 256-bit load and two masks unpack both;
 *         8 bits: [n, k] int8 (q in −127..127);
 *   sc    [n, k/32] int16: each block's scale as an integer multiple of its super-block's
 *   dsup  [n, k/sb] float: scale step, so block scale = dsup·sc (sc ≤ SC_MAX4 or SC_MAX8);
 *   mins  4 bits only: [n, k/32] fp16: each block's minimum, so w = dsup·sc·q + min
 *         (8 bits: w = dsup·sc·q).
 * Activations are quantized on the fly per row, to int8 with one float scale per super-block
 * (`da`), and with each block's sum (`dsa` = da·Σqa) for the minimum term.
 *
 * Within a super-block everything is integer: pmaddubsw multiplies nibbles by int8
 * activations, pmaddwd scales the 16-bit pair sums by the block's integer scale and adds them
 * into 32-bit lanes, and one float FMA per super-block applies dsup·da. Each weight pair is
 * unpacked once for up to ROWS activation rows while it sits in registers, so a verify pass
 * of several rows costs integer arithmetic, not another trip through memory.
 *
 * 8-bit weights use pmaddubsw on |w| and the activations carrying w's sign.
 *
 * Range: |pmaddubsw lane| ≤ 2·15·127 = 3810 (4 bits) or 2·127·127 = 32258 (8 bits); × SC_MAX
 * × 2 per pmaddwd lane, × 8 blocks per super-block stays below 2^31.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32
#define ROWS 4 /* activation rows per unpacked weight pair (more spill registers) */
#define SC_MAX4 16383
#define SC_MAX8 4095
#define PREFETCH 4096 /* bytes of weights fetched ahead of use */

/* x [rows, k] float → qa [rows, k] int8, da [rows, k/sb], dsa [rows, k/32] = da·Σqa (block). */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int64_t sb, int8_t *qa,
                          float *da, float *dsa) {
    const int64_t nb = k / QK, ns = k / sb, per = sb / QK;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t s = 0; s < ns; s++) {
            const float *src = x + r * k + s * sb;
            __m256 amax = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int64_t j = 0; j < sb; j += 8)
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + j)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float max = _mm_cvtss_f32(m4);
            const float d = max / 127.0f;
            const __m256 id = _mm256_set1_ps(max > 0.0f ? 127.0f / max : 0.0f);
            da[r * ns + s] = d;
            for (int64_t b = 0; b < per; b++) {
                int8_t *dst = qa + r * k + s * sb + b * QK;
                __m256i q32[4];
                for (int j = 0; j < 4; j++)  /* round to nearest even, as lrintf */
                    q32[j] = _mm256_cvtps_epi32(
                        _mm256_mul_ps(_mm256_loadu_ps(src + b * QK + 8 * j), id));
                /* int32 → int16 → int8 packs interleave 128-bit lanes; permute them back */
                const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]);
                const __m256i q16b = _mm256_packs_epi32(q32[2], q32[3]);
                __m256i q8 = _mm256_packs_epi16(q16a, q16b);
                q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i *)dst, q8);
                const __m256i s16 = _mm256_madd_epi16(_mm256_add_epi16(q16a, q16b),
                                                      _mm256_set1_epi16(1));
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s16),
                                           _mm256_extracti128_si256(s16, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                dsa[r * nb + s * per + b] = d * (float)_mm_cvtsi128_si32(s4);
            }
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r] for rows 0..nr of one output; `bits` and nr (≤ ROWS) are constants after inlining. */
static inline __attribute__((always_inline)) void output_rows(
    int bits, const uint8_t *qs, const int16_t *sc, const float *dsup, const uint16_t *mins,
    int64_t k, int64_t sb, const int8_t *qa, const float *da, const float *dsa, int nr,
    float *out) {
    const int64_t nb = k / QK, ns = k / sb, pairs = sb / (2 * QK);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS], accm[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m256i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm256_setzero_si256();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const uint8_t *q = qs + b * bits * 4;
            _mm_prefetch((const char *)q + PREFETCH, _MM_HINT_T0);
            __m256i w0, w1;  /* unsigned weight bytes (8 bits: |w|) */
            __m256i sign0 = mask, sign1 = mask;  /* 8 bits: the weights, for their signs */
            if (bits == 4) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)q);
                w0 = _mm256_and_si256(packed, mask);
                w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
            } else {
                _mm_prefetch((const char *)q + PREFETCH + 64, _MM_HINT_T0);
                sign0 = _mm256_loadu_si256((const __m256i *)q);
                sign1 = _mm256_loadu_si256((const __m256i *)(q + QK));
                w0 = _mm256_abs_epi8(sign0);
                w1 = _mm256_abs_epi8(sign1);
            }
            const __m256i s0 = _mm256_set1_epi16(sc[b]), s1 = _mm256_set1_epi16(sc[b + 1]);
            for (int r = 0; r < nr; r++) {
                const int8_t *a = qa + r * k + b * QK;
                __m256i a0 = _mm256_loadu_si256((const __m256i *)a);
                __m256i a1 = _mm256_loadu_si256((const __m256i *)(a + QK));
                if (bits == 8) {
                    a0 = _mm256_sign_epi8(a0, sign0);
                    a1 = _mm256_sign_epi8(a1, sign1);
                }
                const __m256i p0 = _mm256_maddubs_epi16(w0, a0);
                const __m256i p1 = _mm256_maddubs_epi16(w1, a1);
                isum[r] = _mm256_add_epi32(
                    isum[r], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                     _mm256_set1_ps(dsup[s] * da[r * ns + s]), acc[r]);
    }
    int64_t b = bits == 4 ? 0 : nb;  /* the minimum term (4 bits): Σ_b min_b · da·Σqa_b */
    for (; b + 8 <= nb; b += 8) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + b)));
        for (int r = 0; r < nr; r++)
            accm[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(dsa + r * nb + b), accm[r]);
    }
    float tail[ROWS] = {0};
    for (; b < nb; b++)
        for (int r = 0; r < nr; r++) tail[r] += _cvtsh_ss(mins[b]) * dsa[r * nb + b];
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]) + hsum(accm[r]) + tail[r];
}

/* `bits` as a compile-time constant in each copy of output_rows. */
static inline __attribute__((always_inline)) void rows_of(
    int bits, const uint8_t *qs, const int16_t *sc, const float *dsup, const uint16_t *mins,
    int64_t k, int64_t sb, const int8_t *qa, const float *da, const float *dsa, int nr,
    float *out) {
    if (bits == 4) output_rows(4, qs, sc, dsup, mins, k, sb, qa, da, dsa, nr, out);
    else output_rows(8, qs, sc, dsup, mins, k, sb, qa, da, dsa, nr, out);
}

/* y [rows, n] = x [rows, k] · Wᵀ with `bits`-bit weights (4 or 8). Returns 0, −1 when out of
 * memory, −2 on bad arguments. */
int q_matmul(int bits, const float *x, int64_t rows, int64_t k, int64_t sb, const uint8_t *qs,
             const int16_t *sc, const float *dsup, const uint16_t *mins, int64_t n, float *y) {
    if ((bits != 4 && bits != 8) || sb % (2 * QK) || sb > 8 * QK || k % sb) return -2;
    const int64_t nb = k / QK, ns = k / sb;
    int8_t *qa = aligned_alloc(64, ((size_t)(rows * k) + 63) / 64 * 64);
    float *da = malloc(sizeof(float) * (size_t)(rows * ns));
    float *dsa = malloc(sizeof(float) * (size_t)(rows * nb));
    if (!qa || !da || !dsa) {
        free(qa), free(da), free(dsa);
        return -1;
    }
    quantize_rows(x, rows, k, sb, qa, da, dsa);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *wq = qs + o * nb * bits * 4;
        const int16_t *ws = sc + o * nb;
        const float *wd = dsup + o * ns;
        const uint16_t *wm = bits == 4 ? mins + o * nb : NULL;
        float out[ROWS];
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            const int nr = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
            const int8_t *a = qa + r0 * k;
            const float *d = da + r0 * ns, *ds = dsa + r0 * nb;
            switch (nr) {  /* constant row counts, so the accumulators live in registers */
            case 1: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, 1, out); break;
            case 2: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, 2, out); break;
            case 3: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, 3, out); break;
            default: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, ROWS, out); break;
            }
            for (int r = 0; r < nr; r++) y[(r0 + r) * n + o] = out[r];
        }
    }
    free(qa), free(da), free(dsa);
    return 0;
}

int q_sc_max(int bits) { return bits == 4 ? SC_MAX4 : SC_MAX8; }
