/* Matrix multiplies for x86-64 CPUs: 4- and 8-bit weights × 8-bit activations (`q_matmul`),
 * and float32 or bfloat16 weights × float32 activations (`f_matmul`).
 *
 * The same source builds twice (see `specserve/kernels/__init__.py`): with AVX2, FMA and F16C
 * (-march=x86-64-v3), and with AVX-512 F/BW/VL/VNNI on top (-march=x86-64-v4 -mavx512vnni,
 * which defines QM_AVX512). `q_isa()` says which one was loaded.
 *
 * Batch invariance. A row's result never depends on the other rows of its call, on how many
 * there are, or on which loop order (path) the call took: every (row, output) is reduced in
 * one fixed order, each row in its own accumulators, and the tiles only decide which rows
 * share a weight load. Both builds give bit-identical results too: the AVX-512 build keeps
 * the AVX2 build's 8-lane float accumulation and folds its wider integer lanes into those 8
 * lanes (exact) before converting to float.
 *
 * Quantized weights W [n, k], per output row, in blocks of 32 inputs grouped into
 * super-blocks of `sb` inputs (64, 128 or 256; k a multiple of sb):
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
 * activations, pmaddwd (AVX-512 VNNI: vpdpwssd) scales the 16-bit pair sums by the block's
 * integer scale and adds them into 32-bit lanes, and one float FMA per super-block applies
 * dsup·da. Each weight pair is unpacked once for up to ROWS activation rows while it sits in
 * registers (4 with AVX2's 16 vector registers, 8 with AVX-512's 32), so a verify pass of
 * several rows costs integer arithmetic, not another trip through memory. Long passes
 * (prefill) walk blocks of outputs × blocks of rows sized for the L2 cache, so the quantized
 * activations are read from cache rather than streamed from memory once per output.
 *
 * 8-bit weights use pmaddubsw on |w| and the activations carrying w's sign.
 *
 * Range: |pmaddubsw lane| ≤ 2·15·127 = 3810 (4 bits) or 2·127·127 = 32258 (8 bits), so it
 * never saturates; × SC_MAX × 2 per pmaddwd lane, × 8 blocks per super-block stays below 2^31,
 * so every integer sum is exact whatever the order of its terms.
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
#define SC_MAX8 4095
#define PREFETCH 4096      /* bytes of weights fetched ahead of use */
#define OUT_BLOCK 16       /* tiled path: outputs per block */
#define ROW_BYTES 196608   /* tiled path: quantized activation bytes per row block (L2) */
#define FR 4               /* float kernel: rows per tile */

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

/* The float tail shared by both builds: the minimum term (4 bits), Σ_b min_b · da·Σqa_b, and
 * the horizontal sums. out[r] for the nr rows whose super-block sums are in acc. */
static inline __attribute__((always_inline)) void finish_rows(
    int bits, const uint16_t *mins, int64_t nb, const float *dsa, int nr, const __m256 *acc,
    float *out) {
    __m256 accm[ROWS];
    for (int r = 0; r < nr; r++) accm[r] = _mm256_setzero_ps();
    int64_t b = bits == 4 ? 0 : nb;
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

#if QM_AVX512
/* y[r] for rows 0..nr of one output; `bits` and nr (≤ ROWS) are constants after inlining.
 * A zmm register holds a block pair: lanes 0..7 block 2p, lanes 8..15 block 2p + 1; folding
 * the two halves gives exactly the AVX2 build's 8 integer lanes. */
static inline __attribute__((always_inline)) void output_rows(
    int bits, const uint8_t *qs, const int16_t *sc, const float *dsup, const uint16_t *mins,
    int64_t k, int64_t sb, const int8_t *qa, const float *da, const float *dsa, int nr,
    float *out) {
    const int64_t nb = k / QK, ns = k / sb, pairs = sb / (2 * QK);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m256 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m512i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm512_setzero_si512();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const uint8_t *q = qs + b * bits * 4;
            _mm_prefetch((const char *)q + PREFETCH, _MM_HINT_T0);
            __m512i w, sign = mask;
            if (bits == 4) {
                const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
                w = _mm512_and_si512(_mm512_srlv_epi16(packed, shift), mask);
            } else {
                _mm_prefetch((const char *)q + PREFETCH + 64, _MM_HINT_T0);
                sign = _mm512_loadu_si512((const void *)q);
                w = _mm512_abs_epi8(sign);
            }
            const __mmask64 neg = bits == 8 ? _mm512_movepi8_mask(sign) : 0;
            const __m512i scale = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi16(sc[b])), _mm256_set1_epi16(sc[b + 1]), 1);
            for (int r = 0; r < nr; r++) {
                __m512i a = _mm512_loadu_si512((const void *)(qa + r * k + b * QK));
                if (bits == 8) a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(w, a), scale);
            }
        }
        for (int r = 0; r < nr; r++) {
            const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(isum[r]),
                                                    _mm512_extracti64x4_epi64(isum[r], 1));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded),
                                     _mm256_set1_ps(dsup[s] * da[r * ns + s]), acc[r]);
        }
    }
    finish_rows(bits, mins, nb, dsa, nr, acc, out);
}
#else
/* y[r] for rows 0..nr of one output; `bits` and nr (≤ ROWS) are constants after inlining. */
static inline __attribute__((always_inline)) void output_rows(
    int bits, const uint8_t *qs, const int16_t *sc, const float *dsup, const uint16_t *mins,
    int64_t k, int64_t sb, const int8_t *qa, const float *da, const float *dsa, int nr,
    float *out) {
    const int64_t nb = k / QK, ns = k / sb, pairs = sb / (2 * QK);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
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
    finish_rows(bits, mins, nb, dsa, nr, acc, out);
}
#endif

/* `bits` as a compile-time constant in each copy of output_rows. */
static inline __attribute__((always_inline)) void rows_of(
    int bits, const uint8_t *qs, const int16_t *sc, const float *dsup, const uint16_t *mins,
    int64_t k, int64_t sb, const int8_t *qa, const float *da, const float *dsa, int nr,
    float *out) {
    if (bits == 4) output_rows(4, qs, sc, dsup, mins, k, sb, qa, da, dsa, nr, out);
    else output_rows(8, qs, sc, dsup, mins, k, sb, qa, da, dsa, nr, out);
}

#define TILE_CASE(n_)                                                              \
    case n_: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, n_, out); break;

/* Rows r0..r1 of output o: tiles of ROWS rows (the last one shorter), written into y. */
static void output_tiles(int bits, const uint8_t *qs, const int16_t *sc, const float *dsup,
                         const uint16_t *mins, int64_t k, int64_t sb, const int8_t *qa,
                         const float *da, const float *dsa, int64_t n, int64_t o, int64_t r0,
                         int64_t r1, float *y) {
    const int64_t nb = k / QK, ns = k / sb;
    const uint8_t *wq = qs + o * nb * bits * 4;
    const int16_t *ws = sc + o * nb;
    const float *wd = dsup + o * ns;
    const uint16_t *wm = bits == 4 ? mins + o * nb : NULL;
    float out[ROWS];
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int nr = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        const int8_t *a = qa + r * k;
        const float *d = da + r * ns, *ds = dsa + r * nb;
        switch (nr) {  /* constant row counts, so the accumulators live in registers */
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3)
#if ROWS > 4
            TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
#endif
        default: rows_of(bits, wq, ws, wd, wm, k, sb, a, d, ds, ROWS, out); break;
        }
        for (int i = 0; i < nr; i++) y[(r + i) * n + o] = out[i];
    }
}

/* y [rows, n] = x [rows, k] · Wᵀ with `bits`-bit weights (4 or 8). `path`: 1 walks the
 * outputs one by one, each over all rows (decode, verify); 2 walks blocks of outputs × blocks
 * of rows (prefill); 0 picks by the number of rows. Every path gives the same bits per row.
 * Returns 0, −1 when out of memory, −2 on bad arguments. */
int q_matmul(int bits, const float *x, int64_t rows, int64_t k, int64_t sb, const uint8_t *qs,
             const int16_t *sc, const float *dsup, const uint16_t *mins, int64_t n, float *y,
             int path) {
    if ((bits != 4 && bits != 8) || sb % (2 * QK) || sb > 8 * QK || k % sb || path < 0 ||
        path > 2 || rows < 0 || n < 0)
        return -2;
    const int64_t nb = k / QK, ns = k / sb;
    int8_t *qa = aligned_alloc(64, ((size_t)(rows * k) + 63) / 64 * 64 + 64);
    float *da = malloc(sizeof(float) * (size_t)(rows * ns + 1));
    float *dsa = malloc(sizeof(float) * (size_t)(rows * nb + 1));
    if (!qa || !da || !dsa) {
        free(qa), free(da), free(dsa);
        return -1;
    }
    int64_t row_block = ROW_BYTES / (k > 0 ? k : 1) / ROWS * ROWS;
    row_block = row_block < ROWS ? ROWS : row_block;
    if (path == 0) path = rows > row_block ? 2 : 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * k, k, sb, qa + r * k, da + r * ns, dsa + r * nb);
        if (path == 1) {
#pragma omp for schedule(static)
            for (int64_t o = 0; o < n; o++)
                output_tiles(bits, qs, sc, dsup, mins, k, sb, qa, da, dsa, n, o, 0, rows, y);
        } else {
            const int64_t blocks = (n + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for schedule(static)
            for (int64_t ob = 0; ob < blocks; ob++) {
                const int64_t o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < n ? o0 + OUT_BLOCK : n;
                for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
                    const int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows;
                    for (int64_t o = o0; o < o1; o++)
                        output_tiles(bits, qs, sc, dsup, mins, k, sb, qa, da, dsa, n, o, r0, r1, y);
                }
            }
        }
    }
    free(qa), free(da), free(dsa);
    return 0;
}

int q_sc_max(int bits) { return bits == 4 ? SC_MAX4 : SC_MAX8; }

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
