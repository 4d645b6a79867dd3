/* Matrix multiplies for x86-64 CPUs: 4-, 6- and 8-bit weights × 8-bit activations (`q_matmul`),
 * and float32 or bfloat16 weights × float32 activations (`f_matmul`).
 *
 * The same source builds twice (see `specserve/kernels/__init__.py`): with AVX2, FMA and F16C
 * (-march=x86-64-v3), and with AVX-512 F/BW/VL/VNNI on top (-march=x86-64-v4 -mavx512vnni,
 * which defines QM_AVX512; the CPU must have AVX-512 F, BW, CD, DQ, VL and VNNI). `q_isa()`
 * says which one was loaded.
 *
 * Batch invariance. A row's result never depends on the other rows of its call, on how many
 * there are, or on which loop order (path) the call took: every (row, output) is reduced in
 * one fixed order, each row in its own accumulators, and the tiles only decide which rows
 * share a weight load. Both builds give bit-identical results too (see "Arithmetic" below).
 *
 * Quantized weights W [n, k], per output row, in blocks of 32 inputs grouped into
 * super-blocks of `sb` inputs (64, 128 or 256; k a multiple of sb):
 *   qs    4 bits: [n, k/64, 32] uint8: 32 bytes hold block 2p in their low and block 2p + 1
 *         in their high nibbles (q in 0..15), so one 256-bit load and two masks unpack both;
 *         6 bits: the same for the low 4 bits of q (q in 0..63);
 *         8 bits: [n, k] int8 (q in −127..127);
 *   qh    6 bits only: [n, k/64, 16] uint8, the top 2 bits of q: byte j of a block pair holds
 *         those of the pair's weights j + 16g (g = 0..3; weights 0..31 are block 2p, 32..63
 *         block 2p + 1) at bits 2g, 2g + 1. AVX-512 broadcasts the 16 bytes to the 4 128-bit
 *         groups of a zmm (byte lane 16g + j: weight 16g + j), rotates group g's 32-bit lanes
 *         left by 4, 2, 0, 30 so that each field sits at bits 4-5 of its own byte, masks 0x30
 *         and ors them into the nibbles; AVX2 does the same per block with two 256-bit
 *         variable shifts (block 2p: groups 0, 1 left by 4, 2; block 2p + 1: groups 2, 3
 *         right by 0, 2);
 *   sc    [n, k/32] int16: each block's scale as an integer multiple of its super-block's
 *   dsup  [n, k/sb] float: scale step, so block scale = dsup·sc (sc ≤ SC_MAX4, SC_MAX6 or
 *         SC_MAX8);
 *   mins  4 and 6 bits: [n, k/32] fp16: each block's minimum, so w = dsup·sc·q + min
 *         (8 bits: w = dsup·sc·q).
 * Activations are quantized on the fly per row, to int8 with one float scale per super-block
 * (`da`), and with each block's sum (`dsa` = da·Σqa) for the minimum term.
 *
 * Arithmetic, the same bits on every path and build. For a row and an output, each
 * super-block's dot product I_s = Σ_b sc_b · Σ_i q_i·qa_i is an exact integer (summed in 64
 * bits); the row accumulates y = fma((float)I_s, dsup_s·da_s, y) over the super-blocks in
 * order; then y + the minimum term (4, 6 bits: Σ_b min_b·dsa_b in 8 float lanes, lane j taking
 * blocks j, j + 8, ..., summed as `hsum` does, then the blocks past the last full 8 one by
 * one). Since I_s is exact, it does not matter how its terms are grouped, and each path
 * groups them its own way:
 *
 * - decode (few rows, `output_rows`): per output, pmaddubsw multiplies unsigned weights by int8
 *   activations and pmaddwd (AVX-512 VNNI: vpdpwssd, two blocks per zmm) scales the 16-bit
 *   pair sums by the block's integer scale into 32-bit lanes; each weight pair is unpacked
 *   once for up to ROWS activation rows while it sits in registers (4 with AVX2's 16 vector
 *   registers, 8 with AVX-512's 32), so a verify pass costs arithmetic, not another trip
 *   through memory. The lanes are summed exactly (as doubles) per super-block.
 * - prefill (many rows, `tile_rows`): AVX-512 VNNI, 16 outputs in the lanes × 6 rows; AVX2,
 *   4-bit weights only (6 and 8 bits take the decode loop there), 8 outputs × 3 rows. The
 *   weights of the outputs are rearranged once per call so that vpdpbusd (AVX2: pmaddubsw)
 *   multiplies 4 inputs of each output by 4 broadcast activation bytes; a block is 8 such
 *   steps into one register, scaled once by the outputs' block scales: about half the decode
 *   loop's vector multiplies per product, and its float steps shared by all the outputs of
 *   the register.
 *
 * 8-bit weights use pmaddubsw on |w| and the activations carrying w's sign.
 *
 * 8-bit weights on the prefill tiles: vpdpbusd on the activations + 128 (unsigned) and the
 * signed weights, less 128·Σq of the block.
 *
 * Range: |pmaddubsw lane| ≤ 2·15·127 = 3810 (4 bits), 2·63·127 = 16002 (6 bits) or
 * 2·127·127 = 32258 (8 bits), so it never saturates. An int32 lane of the decode loop takes
 * 2 such lanes × sc per pmaddwd (vpdpwssd), 2 blocks' worth per pair on AVX2 (and 2 after
 * AVX-512 folds its 16 lanes to 8), × 4 pairs per super-block: ≤ 16·lane·SC_MAX, i.e.
 * 16·3810·16383 = 1.0e9, 16·16002·4095 = 1.05e9, 16·32258·4095 = 2.11e9 < 2^31. A block's
 * scaled sum on the tiles, ≤ 32·15·127·SC_MAX4 = 1.0e9, 32·63·127·SC_MAX6 = 1.05e9 or
 * 32·127·127·SC_MAX8 = 2.11e9 (8 bits: scaled after the 128·Σq correction; before it,
 * |Σ (qa + 128)·q| ≤ 32·255·127), stays below 2^31 too; the super-block's sum, up to 8
 * times that, is summed in 64 bits (or exactly in doubles).
 * AVX2's tiles add 8 pmaddubsw lanes in 16 bits: ≤ 8·3810 = 30480 for 4 bits, which is why
 * 6 bits (8·16002) do not go there.
 *
 * Float weights: each (row, output) accumulates in 8 float lanes, lane j taking inputs
 * j, j + 8, j + 16, ... by FMA in order (the last partial group zero-padded), then one fixed
 * horizontal sum, then the bias. A tile of FR rows × FO outputs shares each weight load.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QM_AVX512 1
#define ROWS 8 /* activation rows per unpacked weight pair */
#define FO 4   /* float kernel: outputs per tile */
#else
#define QM_AVX512 0
#define ROWS 4 /* (more spill registers) */
#define FO 2
#endif

#define QK 32
#define SC_MAX4 16383
#define SC_MAX6 4095
#define SC_MAX8 4095
#define PREFETCH 4096      /* bytes of weights fetched ahead of use */
#define OUT_BLOCK 16       /* tiled path: outputs per block */
#define ROW_BYTES 196608   /* tiled path: quantized activation bytes per row block (L2) */
#define FR 4               /* float kernel: rows per tile */
#define PREFILL_ROWS 32    /* path 0: from this many rows on, the prefill tiles */
#define QS_BYTES(bits) ((bits) == 8 ? QK : QK / 2)  /* bytes of qs per block */

/* x [k] float → qa [k] int8, da [k/sb], dsa [k/32] = da·Σqa (block) for one row. */
static void quantize_row(const float *x, int64_t k, int64_t sb, int8_t *qa, float *da,
                         float *dsa) {
    const int64_t ns = k / sb, per = sb / QK;
    for (int64_t s = 0; s < ns; s++) {
        const float *src = x + s * sb;
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
        da[s] = d;
        for (int64_t b = 0; b < per; b++) {
            int8_t *dst = qa + s * sb + b * QK;
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
            dsa[s * per + b] = d * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The output of nr rows from their super-block sums `main`: + the minimum term (4, 6 bits),
 * Σ_b min_b · da·Σqa_b, in 8 lanes (lane j: blocks j, j + 8, ...), the lanes summed as hsum
 * does, the blocks past the last full 8 one by one. */
static inline __attribute__((always_inline)) void finish_rows(
    int bits, const uint16_t *mins, int64_t nb, const float *dsa, int nr, const float *main,
    float *out) {
    __m256 accm[ROWS];
    for (int r = 0; r < nr; r++) accm[r] = _mm256_setzero_ps();
    int64_t b = bits != 8 ? 0 : nb;
    for (; b + 8 <= nb; b += 8) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + b)));
        for (int r = 0; r < nr; r++)
            accm[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(dsa + r * nb + b), accm[r]);
    }
    float tail[ROWS] = {0};
    for (; b < nb; b++)
        for (int r = 0; r < nr; r++) tail[r] += _cvtsh_ss(mins[b]) * dsa[r * nb + b];
    for (int r = 0; r < nr; r++) out[r] = main[r] + hsum(accm[r]) + tail[r];
}

#if QM_AVX512
/* Lane r: the exact sum of d[r]'s 8 lanes (integers in doubles: every partial sum exact). */
static inline __m256 row_totals(const __m512d *d) {
#define PAIR(u, v) _mm512_add_pd(_mm512_unpacklo_pd(u, v), _mm512_unpackhi_pd(u, v))
#define HALVES(u, v) \
    _mm512_add_pd(_mm512_shuffle_f64x2(u, v, 0x88), _mm512_shuffle_f64x2(u, v, 0xDD))
    const __m512d a01 = PAIR(d[0], d[1]), a23 = PAIR(d[2], d[3]);
    const __m512d a45 = PAIR(d[4], d[5]), a67 = PAIR(d[6], d[7]);
    const __m512d b = HALVES(a01, a23), c = HALVES(a45, a67);
    return _mm512_cvtpd_ps(HALVES(b, c));  /* lanes: rows 0..7 */
#undef PAIR
#undef HALVES
}

/* y[r] for rows 0..nr of one output; `bits` and nr (≤ ROWS) are constants after inlining.
 * A zmm register holds a block pair: lanes 0..7 block 2p, lanes 8..15 block 2p + 1. `dat`:
 * the rows' da transposed ([ns][stride], lanes past nr readable). */
static inline __attribute__((always_inline)) void output_rows(
    int bits, const uint8_t *qs, const uint8_t *qh, const int16_t *sc, const float *dsup,
    const uint16_t *mins, int64_t k, int64_t sb, const int8_t *qa, const float *dat,
    int64_t stride, const float *dsa, int nr, float *out) {
    const int64_t nb = k / QK, ns = k / sb, pairs = sb / (2 * QK);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i rot = _mm512_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 30, 30, 30, 30);
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512i pick =  /* bytes 0, 1 into every word of the low half, 2, 3 of the high */
        _mm512_inserti64x4(_mm512_set1_epi16(0x0100), _mm256_set1_epi16(0x0302), 1);
    __m256 mainv = _mm256_setzero_ps();  /* lane r: row r */
    float mains[ROWS] = {0};  /* the same, for 1 or 2 rows */
    for (int64_t s = 0; s < ns; s++) {
        __m512i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm512_setzero_si512();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const uint8_t *q = qs + b * QS_BYTES(bits);
            _mm_prefetch((const char *)q + PREFETCH, _MM_HINT_T0);
            __m512i w, sign = mask;
            if (bits != 8) {
                const __m512i packed =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
                w = _mm512_and_si512(_mm512_srlv_epi16(packed, shift), mask);
            }
            if (bits == 6) {  /* the top 2 bits to bits 4-5 of each weight's byte, or'ed in */
                const uint8_t *h = qh + b * 8;
                if (!(b & 7))  /* once per 64-byte line */
                    _mm_prefetch((const char *)h + PREFETCH / 2, _MM_HINT_T0);
                const __m512i high = _mm512_rolv_epi32(
                    _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)h)), rot);
                w = _mm512_ternarylogic_epi32(w, high, top, 0xF8);  /* w | (high & top) */
            } else if (bits == 8) {
                _mm_prefetch((const char *)q + PREFETCH + 64, _MM_HINT_T0);
                sign = _mm512_loadu_si512((const void *)q);
                w = _mm512_abs_epi8(sign);
            }
            const __mmask64 neg = bits == 8 ? _mm512_movepi8_mask(sign) : 0;
            int32_t both;  /* sc[b], sc[b + 1]: broadcast, then each half picks its word */
            memcpy(&both, sc + b, 4);
            const __m512i scale = _mm512_shuffle_epi8(_mm512_set1_epi32(both), pick);
            for (int r = 0; r < nr; r++) {
                __m512i a = _mm512_loadu_si512((const void *)(qa + r * k + b * QK));
                if (bits == 8) a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(w, a), scale);
            }
        }
        __m512d d[8];  /* each row's lanes, folded to 8, exact, as doubles */
        for (int r = 0; r < 8; r++) {
            const __m256i lanes = r < nr ? _mm256_add_epi32(_mm512_castsi512_si256(isum[r]),
                                                            _mm512_extracti64x4_epi64(isum[r], 1))
                                         : _mm256_setzero_si256();
            d[r] = _mm512_cvtepi32_pd(lanes);
        }
        if (nr <= 2) {  /* few rows: each row's total on its own (the same exact value) */
            for (int r = 0; r < nr; r++)
                mains[r] = fmaf((float)_mm512_reduce_add_pd(d[r]), dsup[s] * dat[s * stride + r],
                                mains[r]);
        } else {
            const __m256 scale =
                _mm256_mul_ps(_mm256_set1_ps(dsup[s]), _mm256_loadu_ps(dat + s * stride));
            mainv = _mm256_fmadd_ps(row_totals(d), scale, mainv);
        }
    }
    float main[8];
    _mm256_storeu_ps(main, mainv);
    if (nr <= 2)
        for (int r = 0; r < nr; r++) main[r] = mains[r];
    finish_rows(bits, mins, nb, dsa, nr, main, out);
}
#else
/* y[r] for rows 0..nr of one output; `bits` and nr (≤ ROWS) are constants after inlining. */
static inline __attribute__((always_inline)) void output_rows(
    int bits, const uint8_t *qs, const uint8_t *qh, const int16_t *sc, const float *dsup,
    const uint16_t *mins, int64_t k, int64_t sb, const int8_t *qa, const float *dat,
    int64_t stride, const float *dsa, int nr, float *out) {
    const int64_t nb = k / QK, ns = k / sb, pairs = sb / (2 * QK);
    (void)ns;
    const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i left = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2);
    const __m256i right = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    __m128 mainv = _mm_setzero_ps();  /* lane r: row r */
    float mains = 0.0f;  /* the same, for one row */
    for (int64_t s = 0; s < ns; s++) {
        __m256i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm256_setzero_si256();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const uint8_t *q = qs + b * QS_BYTES(bits);
            _mm_prefetch((const char *)q + PREFETCH, _MM_HINT_T0);
            __m256i w0, w1;  /* unsigned weight bytes (8 bits: |w|) */
            __m256i sign0 = mask, sign1 = mask;  /* 8 bits: the weights, for their signs */
            if (bits != 8) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)q);
                w0 = _mm256_and_si256(packed, mask);
                w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
            }
            if (bits == 6) {  /* the top 2 bits to bits 4-5 of each weight's byte, or'ed in */
                const uint8_t *hp = qh + b * 8;
                if (!(b & 7))  /* once per 64-byte line */
                    _mm_prefetch((const char *)hp + PREFETCH / 2, _MM_HINT_T0);
                const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hp));
                w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_sllv_epi32(h, left), top));
                w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_srlv_epi32(h, right), top));
            } else if (bits == 8) {
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
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(p0, s0),
                                                                     _mm256_madd_epi16(p1, s1)));
            }
        }
        __m256d d[4];  /* each row's 8 lanes, exact, in 4 doubles */
        for (int r = 0; r < 4; r++)
            d[r] = r < nr ? _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(isum[r])),
                                          _mm256_cvtepi32_pd(_mm256_extracti128_si256(isum[r], 1)))
                          : _mm256_setzero_pd();
        if (nr == 1) {  /* one row: its total on its own (the same exact value) */
            __m128d h = _mm_add_pd(_mm256_castpd256_pd128(d[0]), _mm256_extractf128_pd(d[0], 1));
            h = _mm_add_sd(h, _mm_unpackhi_pd(h, h));
            mains = fmaf((float)_mm_cvtsd_f64(h), dsup[s] * dat[s * stride], mains);
        } else {
            const __m256d h01 = _mm256_hadd_pd(d[0], d[1]), h23 = _mm256_hadd_pd(d[2], d[3]);
            const __m256d tot = _mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20),
                                              _mm256_permute2f128_pd(h01, h23, 0x31));
            const __m128 scale = _mm_mul_ps(_mm_set1_ps(dsup[s]), _mm_loadu_ps(dat + s * stride));
            mainv = _mm_fmadd_ps(_mm256_cvtpd_ps(tot), scale, mainv);
        }
    }
    float main[4];
    _mm_storeu_ps(main, mainv);
    if (nr == 1) main[0] = mains;
    finish_rows(bits, mins, nb, dsa, nr, main, out);
}
#endif

/* `bits` as a compile-time constant in each copy of output_rows. */
static inline __attribute__((always_inline)) void rows_of(
    int bits, const uint8_t *qs, const uint8_t *qh, const int16_t *sc, const float *dsup,
    const uint16_t *mins, int64_t k, int64_t sb, const int8_t *qa, const float *dat,
    int64_t stride, const float *dsa, int nr, float *out) {
    if (bits == 4) output_rows(4, qs, qh, sc, dsup, mins, k, sb, qa, dat, stride, dsa, nr, out);
    else if (bits == 6)
        output_rows(6, qs, qh, sc, dsup, mins, k, sb, qa, dat, stride, dsa, nr, out);
    else output_rows(8, qs, qh, sc, dsup, mins, k, sb, qa, dat, stride, dsa, nr, out);
}

#define TILE_CASE(n_)                                                              \
    case n_: rows_of(bits, wq, wh, ws, wd, wm, k, sb, a, d, stride, ds, n_, out); break;

/* Rows r0..r1 of output o: tiles of ROWS rows (the last one shorter), written into y.
 * `dat` [ns][stride]: the rows' super-block scales da, transposed. */
static void output_tiles(int bits, const uint8_t *qs, const uint8_t *qh, const int16_t *sc,
                         const float *dsup, const uint16_t *mins, int64_t k, int64_t sb,
                         const int8_t *qa, const float *dat, int64_t stride, const float *dsa,
                         int64_t n, int64_t o, int64_t r0, int64_t r1, float *y) {
    const int64_t nb = k / QK, ns = k / sb;
    const uint8_t *wq = qs + o * nb * QS_BYTES(bits);
    const uint8_t *wh = bits == 6 ? qh + o * nb * 8 : NULL;
    const int16_t *ws = sc + o * nb;
    const float *wd = dsup + o * ns;
    const uint16_t *wm = bits != 8 ? mins + o * nb : NULL;
    float out[ROWS];
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int nr = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        const int8_t *a = qa + r * k;
        const float *d = dat + r, *ds = dsa + r * nb;
        switch (nr) {  /* constant row counts, so the accumulators live in registers */
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3)
#if ROWS > 4
            TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
#endif
        default: rows_of(bits, wq, wh, ws, wd, wm, k, sb, a, d, stride, ds, ROWS, out); break;
        }
        for (int i = 0; i < nr; i++) y[(r + i) * n + o] = out[i];
    }
}

/* ---- prefill tiles: TOUT outputs in the lanes × TROWS rows ----
 * The weights of TOUT outputs are first rearranged (once per call and block of outputs) so
 * that one register holds 4 consecutive inputs of each of the outputs. AVX-512 VNNI:
 * vpdpbusd multiplies them by 4 broadcast activation bytes of a row and sums each group of 4
 * into its output's lane, so a block of 32 inputs is 8 such steps into one register (6-bit
 * weights, unsigned like 4-bit ones, the same way); AVX2 (4 bits only): pmaddubsw, its
 * 16-bit pair sums added up over the block's 8 steps (≤ 8·3810, no overflow), then one
 * pmaddwd by 1. Either way each block is scaled once by the outputs'
 * block scales and summed exactly over the super-block (64-bit integers, or doubles). The
 * float steps are the decode loop's, lane by lane, so every row gets the same bits as there.
 * Rows past the last full tile and outputs past the last full TOUT take the decode loop. */
#if QM_AVX512
#define TOUT 16
#define TROWS 6
#else
#define TOUT 8
#define TROWS 3
#endif

typedef struct {
    uint8_t *w;      /* [nb][8][16][4] weight bytes: 4, 6 bits q (unsigned), 8 bits q (signed) */
    int32_t *sc;     /* [nb][16] block scales */
    int32_t *wsum;   /* 8 bits: [nb][16] 128·Σq of the block (for the +128 activations) */
    float *dsup;     /* [ns][16] */
    float *mins;     /* 4, 6 bits: [nb][16] */
} packed_t;

static void pack_outputs(int bits, const uint8_t *qs, const uint8_t *qh, const int16_t *sc,
                         const float *dsup, const uint16_t *mins, int64_t k, int64_t sb,
                         int64_t o0, packed_t *pk) {
    const int64_t nb = k / QK, ns = k / sb;
    for (int o = 0; o < TOUT; o++) {
        const int64_t out = o0 + o;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t q[QK];
            if (bits != 8) {
                const uint8_t *src = qs + out * nb * 16 + (b / 2) * QK;
                for (int i = 0; i < QK; i++) q[i] = b % 2 ? src[i] >> 4 : src[i] & 0x0F;
            }
            if (bits == 6) {  /* weight i of block b: field g = 2·(b % 2) + i / 16 of byte i % 16 */
                const uint8_t *high = qh + out * nb * 8 + (b / 2) * 16;
                for (int i = 0; i < QK; i++)
                    q[i] |= ((high[i % 16] >> (2 * (2 * (b % 2) + i / 16))) & 3) << 4;
            } else if (bits == 8) {
                const int8_t *src = (const int8_t *)qs + out * k + b * QK;
                int32_t sum = 0;
                for (int i = 0; i < QK; i++) q[i] = (uint8_t)src[i], sum += src[i];
                pk->wsum[b * TOUT + o] = 128 * sum;
            }
            for (int g = 0; g < 8; g++)
                memcpy(pk->w + ((b * 8 + g) * TOUT + o) * 4, q + 4 * g, 4);
            pk->sc[b * TOUT + o] = sc[out * nb + b];
            if (bits != 8) pk->mins[b * TOUT + o] = _cvtsh_ss(mins[out * nb + b]);
        }
        for (int64_t s = 0; s < ns; s++) pk->dsup[s * TOUT + o] = dsup[out * ns + s];
    }
}

#if QM_AVX512
/* y[r, o0..o0 + 16] for TROWS rows from `a` (8 bits: the activations + 128). */
static inline __attribute__((always_inline)) void tile_rows(
    int bits, const packed_t *pk, int64_t k, int64_t sb, const int8_t *a, const float *da,
    const float *dsa, int64_t n, float *y) {
    const int64_t nb = k / QK, ns = k / sb, per = sb / QK;
    __m512 main[TROWS];
    for (int r = 0; r < TROWS; r++) main[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m512i lo[TROWS], hi[TROWS];
        for (int r = 0; r < TROWS; r++) lo[r] = hi[r] = _mm512_setzero_si512();
        for (int64_t b = s * per; b < (s + 1) * per; b++) {
            __m512i t[TROWS];
            for (int r = 0; r < TROWS; r++) t[r] = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                const __m512i w = _mm512_loadu_si512((const void *)(pk->w + (b * 8 + g) * 64));
                for (int r = 0; r < TROWS; r++) {
                    int32_t four;
                    memcpy(&four, a + r * k + b * QK + 4 * g, 4);
                    const __m512i x = _mm512_set1_epi32(four);
                    t[r] = bits != 8 ? _mm512_dpbusd_epi32(t[r], w, x)
                                     : _mm512_dpbusd_epi32(t[r], x, w);
                }
            }
            const __m512i scale = _mm512_loadu_si512((const void *)(pk->sc + b * TOUT));
            const __m512i bias = bits == 8 ? _mm512_loadu_si512((const void *)(pk->wsum + b * TOUT))
                                           : _mm512_setzero_si512();
            for (int r = 0; r < TROWS; r++) {
                const __m512i prod = _mm512_mullo_epi32(
                    bits == 8 ? _mm512_sub_epi32(t[r], bias) : t[r], scale);
                const __m256i low = _mm512_castsi512_si256(prod);
                const __m256i high = _mm512_extracti64x4_epi64(prod, 1);
                lo[r] = _mm512_add_epi64(lo[r], _mm512_cvtepi32_epi64(low));
                hi[r] = _mm512_add_epi64(hi[r], _mm512_cvtepi32_epi64(high));
            }
        }
        const __m512 ds = _mm512_loadu_ps(pk->dsup + s * TOUT);
        for (int r = 0; r < TROWS; r++) {
            const __m512 isum = _mm512_insertf32x8(
                _mm512_castps256_ps512(_mm512_cvtepi64_ps(lo[r])),
                                                   _mm512_cvtepi64_ps(hi[r]), 1);
            const __m512 scale = _mm512_mul_ps(ds, _mm512_set1_ps(da[r * ns + s]));
            main[r] = _mm512_fmadd_ps(isum, scale, main[r]);
        }
    }
    for (int r = 0; r < TROWS; r++) {  /* the minimum term, as finish_rows sums it */
        __m512 m = _mm512_setzero_ps(), tail = _mm512_setzero_ps();
        if (bits != 8) {
            __m512 lane[8];
            for (int j = 0; j < 8; j++) lane[j] = _mm512_setzero_ps();
            int64_t b = 0;
            for (; b + 8 <= nb; b += 8)
                for (int j = 0; j < 8; j++)
                    lane[j] = _mm512_fmadd_ps(_mm512_loadu_ps(pk->mins + (b + j) * TOUT),
                                              _mm512_set1_ps(dsa[r * nb + b + j]), lane[j]);
            const __m512 even = _mm512_add_ps(_mm512_add_ps(lane[0], lane[4]),
                                              _mm512_add_ps(lane[2], lane[6]));
            const __m512 odd = _mm512_add_ps(_mm512_add_ps(lane[1], lane[5]),
                                             _mm512_add_ps(lane[3], lane[7]));
            m = _mm512_add_ps(even, odd);
            for (; b < nb; b++)
                tail = _mm512_add_ps(tail, _mm512_mul_ps(_mm512_loadu_ps(pk->mins + b * TOUT),
                                                         _mm512_set1_ps(dsa[r * nb + b])));
        }
        _mm512_storeu_ps(y + r * n, _mm512_add_ps(_mm512_add_ps(main[r], m), tail));
    }
}
#else
/* y[r, o0..o0 + 8] for TROWS rows, 4-bit weights. */
static inline __attribute__((always_inline)) void tile_rows(
    int bits, const packed_t *pk, int64_t k, int64_t sb, const int8_t *a, const float *da,
    const float *dsa, int64_t n, float *y) {
    (void)bits;
    const int64_t nb = k / QK, ns = k / sb, per = sb / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 main[TROWS];
    for (int r = 0; r < TROWS; r++) main[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m256d lo[TROWS], hi[TROWS];
        for (int r = 0; r < TROWS; r++) lo[r] = hi[r] = _mm256_setzero_pd();
        for (int64_t b = s * per; b < (s + 1) * per; b++) {
            __m256i t[TROWS];
            for (int r = 0; r < TROWS; r++) t[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(pk->w + (b * 8 + g) * 32));
                for (int r = 0; r < TROWS; r++) {
                    int32_t four;
                    memcpy(&four, a + r * k + b * QK + 4 * g, 4);
                    t[r] = _mm256_add_epi16(t[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
                }
            }
            const __m256i scale = _mm256_loadu_si256((const __m256i *)(pk->sc + b * TOUT));
            for (int r = 0; r < TROWS; r++) {
                const __m256i prod = _mm256_mullo_epi32(_mm256_madd_epi16(t[r], ones), scale);
                lo[r] = _mm256_add_pd(lo[r], _mm256_cvtepi32_pd(_mm256_castsi256_si128(prod)));
                hi[r] = _mm256_add_pd(hi[r], _mm256_cvtepi32_pd(_mm256_extracti128_si256(prod, 1)));
            }
        }
        const __m256 ds = _mm256_loadu_ps(pk->dsup + s * TOUT);
        for (int r = 0; r < TROWS; r++) {
            const __m256 isum = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo[r])),
                                                     _mm256_cvtpd_ps(hi[r]), 1);
            const __m256 scale = _mm256_mul_ps(ds, _mm256_set1_ps(da[r * ns + s]));
            main[r] = _mm256_fmadd_ps(isum, scale, main[r]);
        }
    }
    for (int r = 0; r < TROWS; r++) {  /* the minimum term, as finish_rows sums it */
        __m256 lane[8];
        for (int j = 0; j < 8; j++) lane[j] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
            for (int j = 0; j < 8; j++)
                lane[j] = _mm256_fmadd_ps(_mm256_loadu_ps(pk->mins + (b + j) * TOUT),
                                          _mm256_set1_ps(dsa[r * nb + b + j]), lane[j]);
        const __m256 m = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(lane[0], lane[4]), _mm256_add_ps(lane[2], lane[6])),
            _mm256_add_ps(_mm256_add_ps(lane[1], lane[5]), _mm256_add_ps(lane[3], lane[7])));
        __m256 tail = _mm256_setzero_ps();
        for (; b < nb; b++)
            tail = _mm256_add_ps(tail, _mm256_mul_ps(_mm256_loadu_ps(pk->mins + b * TOUT),
                                                     _mm256_set1_ps(dsa[r * nb + b])));
        _mm256_storeu_ps(y + r * n, _mm256_add_ps(_mm256_add_ps(main[r], m), tail));
    }
}
#endif

/* output o, rows r0..r1 through the decode loop */
#define OUTPUT_TILES(o, r0, r1, y) \
    output_tiles(bits, qs, qh, sc, dsup, mins, k, sb, qa, dat, stride, dsa, n, o, r0, r1, y)

/* y [rows, n] = x [rows, k] · Wᵀ with `bits`-bit weights (4, 6 or 8; qh: 6 bits only, else
 * NULL; mins: 4 and 6 bits). `path`: 1 walks the outputs one by one, each over all rows
 * (decode, verify); 2 walks blocks of outputs × blocks of rows (prefill: the tiles; the AVX2
 * build's 6- and 8-bit weights, blocks of outputs × blocks of rows through the decode loop);
 * 0 picks by the number of rows (PREFILL_ROWS). Every path gives the same bits per row.
 * Returns 0, −1 when out of memory, −2 on bad arguments. */
int q_matmul(int bits, const float *x, int64_t rows, int64_t k, int64_t sb, const uint8_t *qs,
             const uint8_t *qh, const int16_t *sc, const float *dsup, const uint16_t *mins,
             int64_t n, float *y, int path) {
    if ((bits != 4 && bits != 6 && bits != 8) || sb % (2 * QK) || sb > 8 * QK || k % sb ||
        path < 0 || path > 2 || rows < 0 || n < 0 || (bits == 6 && !qh) || (bits != 8 && !mins))
        return -2;
    const int64_t nb = k / QK, ns = k / sb;
    int64_t row_block = ROW_BYTES / (k > 0 ? k : 1) / ROWS * ROWS;
    row_block = row_block < ROWS ? ROWS : row_block;
    if (path == 0) path = rows >= PREFILL_ROWS ? 2 : 1;
    const int tiles = path == 2 && (QM_AVX512 || bits == 4);  /* AVX2: 4-bit tiles only */
    const size_t act_bytes = ((size_t)(rows * k) + 63) / 64 * 64 + 64;
    int8_t *qa = aligned_alloc(64, act_bytes);
    int8_t *qu = tiles && bits == 8 ? aligned_alloc(64, act_bytes) : NULL;
    float *da = malloc(sizeof(float) * (size_t)(rows * ns + 1));
    float *dsa = malloc(sizeof(float) * (size_t)(rows * nb + 1));
    const int64_t stride = (rows + 7) / 8 * 8 + 8;  /* rows of dat, padded: tiles read 8 lanes */
    float *dat = calloc((size_t)(ns * stride), sizeof(float));
    const int no_memory = !qa || !da || !dsa || !dat || (tiles && bits == 8 && !qu);
    int failed = no_memory;  /* or a thread's tile buffers */
#pragma omp parallel
    {
        if (!no_memory) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                quantize_row(x + r * k, k, sb, qa + r * k, da + r * ns, dsa + r * nb);
                for (int64_t j = 0; j < ns; j++) dat[j * stride + r] = da[r * ns + j];
                if (qu)  /* the activations + 128, unsigned, for vpdpbusd against signed weights */
                    for (int64_t i = 0; i < k; i++) qu[r * k + i] = (int8_t)(qa[r * k + i] ^ 0x80);
            }
        }
        if (no_memory) {
        } else if (path == 1) {
#pragma omp for schedule(static)
            for (int64_t o = 0; o < n; o++)
                OUTPUT_TILES(o, 0, rows, y);
        } else if (tiles) {
            packed_t pk = {aligned_alloc(64, (size_t)(nb * 8 * TOUT * 4)),
                           aligned_alloc(64, (size_t)(nb * TOUT * 4)),
                           aligned_alloc(64, (size_t)(nb * TOUT * 4)),
                           aligned_alloc(64, (size_t)(ns * TOUT * 4)),
                           aligned_alloc(64, (size_t)(nb * TOUT * 4))};
            const int ok = pk.w && pk.sc && pk.wsum && pk.dsup && pk.mins;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
            const int64_t full_rows = rows / TROWS * TROWS, blocks = full_rows ? n / TOUT : 0;
#pragma omp for schedule(static)
            for (int64_t ob = 0; ob < blocks; ob++) {
                if (!ok) continue;
                const int64_t o0 = ob * TOUT;
                pack_outputs(bits, qs, qh, sc, dsup, mins, k, sb, o0, &pk);
                const int8_t *act = bits == 8 ? qu : qa;
                for (int64_t r = 0; r < full_rows; r += TROWS) {
                    if (bits == 4)
                        tile_rows(4, &pk, k, sb, act + r * k, da + r * ns, dsa + r * nb, n,
                                  y + r * n + o0);
                    else if (bits == 6)
                        tile_rows(6, &pk, k, sb, act + r * k, da + r * ns, dsa + r * nb, n,
                                  y + r * n + o0);
                    else
                        tile_rows(8, &pk, k, sb, act + r * k, da + r * ns, dsa + r * nb, n,
                                  y + r * n + o0);
                }
                for (int64_t o = o0; o < o0 + TOUT; o++)  /* the rows left over */
                    OUTPUT_TILES(o, full_rows, rows, y);
            }
#pragma omp for schedule(static)
            for (int64_t o = blocks * TOUT; o < n; o++)  /* the outputs left over */
                OUTPUT_TILES(o, 0, rows, y);
            free(pk.w), free(pk.sc), free(pk.wsum), free(pk.dsup), free(pk.mins);
        } else {
            const int64_t blocks = (n + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for schedule(static)
            for (int64_t ob = 0; ob < blocks; ob++) {
                const int64_t o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < n ? o0 + OUT_BLOCK : n;
                for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
                    const int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows;
                    for (int64_t o = o0; o < o1; o++)
                        OUTPUT_TILES(o, r0, r1, y);
                }
            }
        }
    }
    free(qa), free(qu), free(da), free(dsa), free(dat);
    return failed ? -1 : 0;
}

int q_sc_max(int bits) { return bits == 4 ? SC_MAX4 : bits == 6 ? SC_MAX6 : SC_MAX8; }

/* 2: the AVX-512 VNNI build, 1: the AVX2 build. */
int q_isa(void) { return QM_AVX512 ? 2 : 1; }

/* ---- float weights ---- */

static inline __m256 load_bf16(const uint16_t *p) {  /* 8 bfloat16 → float32, exact */
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load_w(const void *w, int bf16, int64_t at) {
    return bf16 ? load_bf16((const uint16_t *)w + at) : _mm256_loadu_ps((const float *)w + at);
}

/* out[r·FO + o] = Σ_i x[r, i]·w[o, i] for nr rows (stride k) and no outputs (stride k). */
static inline __attribute__((always_inline)) void f_tile(
    const float *x, int64_t k, int nr, const void *w, int bf16, int no, float *out) {
    __m256 acc[FR][FO];
    for (int r = 0; r < nr; r++)
        for (int o = 0; o < no; o++) acc[r][o] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 wv[FO];
        for (int o = 0; o < no; o++) wv[o] = load_w(w, bf16, o * k + i);
        for (int r = 0; r < nr; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + i);
            for (int o = 0; o < no; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    if (i < k) {  /* the last partial group, zero-padded */
        const int left = (int)(k - i);
        float xt[8], wt[8];
        __m256 wv[FO];
        for (int o = 0; o < no; o++) {
            memset(wt, 0, sizeof wt);
            for (int j = 0; j < left; j++) {
                const int64_t at = o * k + i + j;
                if (bf16) {
                    const uint32_t bitsv = (uint32_t)((const uint16_t *)w)[at] << 16;
                    memcpy(&wt[j], &bitsv, 4);
                } else {
                    wt[j] = ((const float *)w)[at];
                }
            }
            wv[o] = _mm256_loadu_ps(wt);
        }
        for (int r = 0; r < nr; r++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + r * k + i, sizeof(float) * (size_t)left);
            const __m256 xv = _mm256_loadu_ps(xt);
            for (int o = 0; o < no; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int o = 0; o < no; o++) out[r * FO + o] = hsum(acc[r][o]);
}

static inline const void *w_row(const void *w, int bf16, int64_t at) {
    return bf16 ? (const void *)((const uint16_t *)w + at) : (const void *)((const float *)w + at);
}

#define F_CASE(nr_, no_, dst)                                                    \
    case nr_: f_tile(x, k, nr_, w, bf16, no_, dst); break;
#define F_ROWS(no_, dst)                                                          \
    switch (nr) { F_CASE(1, no_, dst) F_CASE(2, no_, dst) F_CASE(3, no_, dst)     \
                  default: f_tile(x, k, FR, w, bf16, no_, dst); break; }

/* out[r·FO + o] for nr rows and no outputs: full tiles of FO, or one output at a time. */
static void f_rows(const float *x, int64_t k, int nr, const void *w0, int bf16, int no,
                   float *out) {
    if (no == FO) {
        const void *w = w0;
        F_ROWS(FO, out)
        return;
    }
    for (int o = 0; o < no; o++) {
        const void *w = w_row(w0, bf16, o * k);
        float one[FR * FO];
        F_ROWS(1, one)
        for (int r = 0; r < nr; r++) out[r * FO + o] = one[r * FO];
    }
}

/* y [rows, n] = x [rows, k] · Wᵀ (+ bias [n]), W [n, k] float32 (bf16 = 0) or bfloat16
 * (bf16 = 1, widened exactly). Returns 0, −2 on bad arguments. */
int f_matmul(const float *x, int64_t rows, int64_t k, const void *w, int bf16,
             const float *bias, int64_t n, float *y) {
    if (rows < 0 || k < 0 || n < 0 || (bf16 != 0 && bf16 != 1)) return -2;
    const int64_t tiles = (n + FO - 1) / FO;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * FO;
        const int no = n - o0 < FO ? (int)(n - o0) : FO;
        float out[FR * FO];
        for (int64_t r = 0; r < rows; r += FR) {
            const int nr = rows - r < FR ? (int)(rows - r) : FR;
            f_rows(x + r * k, k, nr, w_row(w, bf16, o0 * k), bf16, no, out);
            for (int i = 0; i < nr; i++)
                for (int o = 0; o < no; o++) {
                    const float v = out[i * FO + o];
                    y[(r + i) * n + o0 + o] = bias ? v + bias[o0 + o] : v;
                }
        }
    }
    return 0;
}
