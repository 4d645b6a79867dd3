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
 * one fixed order, each row in its own accumulators, and the loops only decide which rows
 * share a weight load. Both builds give bit-identical results too (see "Arithmetic" below).
 *
 * Entry points: `q_matmul` and `f_matmul` each run one call in a parallel region of their own;
 * `proj_team` runs either inside a region its caller opened (attention.c's `decoder_pass`, a
 * whole decoder pass in one region), through the same code, so with the same bits.
 *
 * Activations are quantized on the fly per row, to int8 (−127..127) with one float scale per
 * super-block of `sb` inputs (`da`; sb = 64, 128 or 256, k a multiple of sb), and each block of
 * 32 inputs' integer sum (`bs`).
 *
 * ---- 4- and 6-bit weights: outputs in the lanes ----
 * W [n, k] is stored in tiles of 16 outputs (T = ⌈n/16⌉; the outputs past n are zeros), each
 * tile block by block (nb = k/32 blocks, ns = k/sb super-blocks), so that one register holds 4
 * consecutive inputs of each of the 16 outputs:
 *   qs    [T, nb, 4, 64] uint8: chunk c, byte 4l + j (lane l = output 16t + l, j = 0..3): low
 *         nibble = q of input 4c + j of the block, high nibble = q of input 16 + 4c + j (the
 *         low 4 bits of q; so chunk c's low nibbles are input group c, its high ones group c + 4);
 *   qh    6 bits: [T, nb, 2, 64] uint8: plane h, byte 4l + j, bits 2g, 2g + 1 (g = 0..3) = the
 *         top 2 bits of q of input 4(4h + g) + j;
 *   sc    [T, nb, 16] uint8: each block's scale as a multiple (≤ SC_MAX_LANES) of the step dsup;
 *   mins  [T, nb, 16] int8: each block's offset as a multiple (−127..127) of the step dmin;
 *   dsup, dmin  [T, ns, 16] float: the steps of each super-block,
 * so w = dsup·sc·q + dmin·mins (q in 0..15 or 0..63). One loop serves every number of rows
 * (decode, verify and prefill alike): AVX-512 VNNI vpdpbusd multiplies the 16 outputs' 4
 * weight bytes by 4 broadcast activation bytes and sums each group of 4 into its output's lane
 * (a block is 8 such steps into one register); AVX2 does the same on the tile's two halves of
 * 8 outputs with pmaddubsw, and pmaddwd by the block's scale (in both 16-bit halves of each
 * output's lane) takes the 16-bit sums to 32 bits already scaled. Each chunk of weights, once
 * unpacked, serves up to LR rows while it sits in registers: a pass of up to LR rows (decode,
 * verify) takes them all at once, a longer one groups of GROUP(bits) (AVX2: 6 rows for 4-bit
 * weights, 8 for 6-bit, the fastest timed at 256 and 512 rows). The registers go to the rows'
 * integer sums: each row's float outputs stay in memory (`yt`), updated once per super-block.
 *
 * Arithmetic, the same bits on every path and build. For a row and an output, per super-block
 * s in order, with y = 0 at the start:
 *   I_s = Σ_b sc_b · Σ_i q_i·qa_i  and  M_s = Σ_b mins_b · bs_b  (exact 32-bit integers),
 *   y = fma((float)I_s, dsup_s·da_s, y);  y = fma((float)M_s, dmin_s·da_s, y).
 * Range: a block's |Σ q·qa| ≤ 32·63·127 = 256032, times sc ≤ 255, times 8 blocks = 5.2e8 <
 * 2^31; |M_s| ≤ 8·127·32·127 = 4.1e6. AVX2 adds pmaddubsw lanes (≤ 2·15·127 = 3810, or
 * 2·63·127 = 16002) in 16 bits: all 8 groups of a block for 4 bits (≤ 30480), 2 at a time for
 * 6 bits (≤ 32004); pmaddwd by sc ≤ 255 then gives ≤ 2·32004·255 = 1.6e7 per 32-bit lane.
 *
 * ---- 8-bit weights: rows ----
 *   qs    [n, k] int8 (q in −127..127);
 *   sc    [n, k/32] int16: each block's scale as a multiple (≤ SC_MAX8) of its super-block's
 *   dsup  [n, k/sb] float: scale step, so w = dsup·sc·q.
 * For a row and an output, each super-block's I_s = Σ_b sc_b · Σ_i q_i·qa_i is an exact
 * integer (summed in 64 bits); y = fma((float)I_s, dsup_s·da_s, y) over the super-blocks in
 * order. Since I_s is exact, each path groups its terms its own way:
 * - decode (few rows, `rows8`): per output, pmaddubsw multiplies |w| by the activations
 *   carrying w's sign and pmaddwd (AVX-512 VNNI: vpdpwssd, two blocks per zmm) scales the
 *   16-bit pair sums by the block's integer scale into 32-bit lanes; each weight pair serves up
 *   to ROWS activation rows while it sits in registers. The lanes are summed exactly (as
 *   doubles) per super-block.
 * - prefill (AVX-512 VNNI, many rows, `tile_rows8`): 16 outputs in the lanes × TROWS rows, the
 *   outputs' weights rearranged once per call; vpdpbusd on the activations + 128 (unsigned)
 *   and the signed weights, less 128·Σq of the block. The AVX2 build runs its decode loop over
 *   blocks of outputs × blocks of rows instead.
 * Range: |pmaddubsw lane| ≤ 2·127·127 = 32258; an int32 lane of the decode loop takes 2 such
 * lanes × sc per pmaddwd, ≤ 16·32258·4095 = 2.11e9 < 2^31 over a super-block; a block's scaled
 * sum on the tiles, ≤ 32·127·127·4095 (after the 128·Σq correction; before it, |Σ (qa + 128)·q|
 * ≤ 32·255·127), stays below 2^31 too; the super-block's sum is summed in 64 bits.
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

/* The quantized kinds (`kernels/decoder.py` names them too; the layouts above). */
#define KIND_K4 4   /* 4-bit codes, integer block scales and offsets: Q4_K, int4 */
#define KIND_K6 6   /* 6-bit codes, the same: Q5_K, int4's wider tensors */
#define KIND_R8 8   /* 8-bit rows: int8 */
#define KIND_S6 36  /* 6-bit codes, signed integer scales per 16 inputs: Q6_K */
#define KIND_B4 44  /* 4-bit codes, a float16 scale (and offset) per block: Q4_0, Q4_1 */
#define KIND_B6 46  /* 6-bit codes, the same: Q5_0, Q5_1 */
#define KIND_B8 48  /* 8-bit codes, the same: Q8_0 */
#define LANES_KIND(kind)                                                               \
    ((kind) == KIND_K4 || (kind) == KIND_K6 || (kind) == KIND_S6 || (kind) == KIND_B4 || \
     (kind) == KIND_B6 || (kind) == KIND_B8)
#define CODE_BITS(kind) \
    ((kind) == KIND_K4 || (kind) == KIND_B4 ? 4 : (kind) == KIND_B8 ? 8 : 6)
#define FLOAT_BLOCKS(kind) ((kind) == KIND_B4 || (kind) == KIND_B6 || (kind) == KIND_B8)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QM_AVX512 1
#define ROWS 8 /* 8 bits: activation rows per unpacked weight pair */
#define LR 10  /* 4, 6 bits: rows per pass over a tile (a verify pass of 1 + 9 drafts: one) */
#define LR_OF(kind) ((kind) == KIND_S6 ? 6 : LR) /* (S6 holds two sums per row) */
#define GROUP(kind) LR_OF(kind) /* lanes kinds, more than LR_OF rows: rows per pass */
#define FO 4   /* float kernel: outputs per tile */
#else
#define QM_AVX512 0
#define ROWS 4 /* (more spill registers) */
#define LR 9   /* a verify pass of 1 + 8 drafts: one pass over the tile */
#define LR_OF(kind) LR
#define GROUP(kind) (CODE_BITS(kind) == 4 ? 6 : 8) /* more rows (prefill): see the layout above */
#define FO 2
#endif

_Static_assert(GROUP(KIND_K4) <= LR && GROUP(KIND_K6) <= LR && GROUP(KIND_S6) <= LR_OF(KIND_S6),
               "a group of rows is one pass of lanes_rows");

#define QK 32
#define TILE 16            /* 4, 6 bits: outputs per tile */
#define SC_MAX_LANES 255
#define SC_MAX8 4095
/* Weights are fetched PREFETCH bytes ahead of use into L2 (prefetcht1): into L1 (t0), each
 * fetch in flight holds one of L1's few miss buffers, which capped a decode pass's stream at
 * ~80% of the rate L2's deeper queue sustains (Zen 4: 1-row passes 0.70-0.89x the time, in
 * both builds, against t0 4 KB ahead; 8 KB ahead was as fast as 16 KB and faster than 4 KB).
 * But the 4- and 6-bit tiles' one-row passes (decode) fetch into L1, 8 KB ahead: there t1 made
 * a one-row pass slower than a two-row one whenever memory ran fast (8 alternated runs, Zen 4:
 * one row 0.84-1.01x the time with t0, median 0.93x at 4 bits, 0.96x at 6; two to nine rows
 * 0.98-1.25x, so they keep t1). */
#define PREFETCH 8192
#define FETCH_HINT _MM_HINT_T1
/* the lanes loop's prefetch of p for a pass of nr rows (a constant after inlining) */
#define FETCH_LANES(p, nr)                                              \
    do {                                                                \
        if ((nr) == 1) _mm_prefetch((const char *)(p), _MM_HINT_T0);   \
        else _mm_prefetch((const char *)(p), FETCH_HINT);               \
    } while (0)
#define OUT_BLOCK 16       /* 8 bits, AVX2 prefill: outputs per block */
#define ROW_BYTES 196608   /* 8 bits, AVX2 prefill: activation bytes per row block (L2) */
#define FR 4               /* float kernel: rows per tile */
#define PREFILL_ROWS 32    /* path 0: from this many rows on, the prefill tiles */
#define LANE_ROW_BYTES 49152 /* 4, 6 bits: activation bytes one sweep over the tiles takes */

/* x [k] float → qa [k] int8, da [k/ab], bs [k/32] = Σqa per block and bh [k/16] = Σqa per
 * half block (int16: |Σqa| ≤ 32·127) for one row. */
static void quantize_row(const float *x, int64_t k, int64_t ab, int8_t *qa, float *da,
                         int16_t *bs, int16_t *bh) {
    const int64_t nab = k / ab, per = ab / QK;
    for (int64_t s = 0; s < nab; s++) {
        const float *src = x + s * ab;
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int64_t j = 0; j < ab; j += 8)
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max = _mm_cvtss_f32(m4);
        const float d = max / 127.0f;
        const __m256 id = _mm256_set1_ps(max > 0.0f ? 127.0f / max : 0.0f);
        da[s] = d;
        for (int64_t b = 0; b < per; b++) {
            int8_t *dst = qa + s * ab + b * QK;
            __m256i q32[4];
            for (int j = 0; j < 4; j++)  /* round to nearest even, as lrintf */
                q32[j] = _mm256_cvtps_epi32(
                    _mm256_mul_ps(_mm256_loadu_ps(src + b * QK + 8 * j), id));
            /* int32 → int16 → int8 packs interleave 128-bit lanes; permute them back */
            const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]);  /* inputs 0..15 */
            const __m256i q16b = _mm256_packs_epi32(q32[2], q32[3]);  /* inputs 16..31 */
            __m256i q8 = _mm256_packs_epi16(q16a, q16b);
            q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)dst, q8);
            const __m256i one = _mm256_set1_epi16(1);
            const __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(q16a, one),
                                                _mm256_madd_epi16(q16b, one));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            s4 = _mm_hadd_epi32(s4, s4);  /* lane 0: Σ inputs 0..15, lane 1: 16..31 */
            const int32_t lo = _mm_cvtsi128_si32(s4), hi = _mm_extract_epi32(s4, 1);
            const int64_t blk = s * per + b;
            bh[2 * blk] = (int16_t)lo, bh[2 * blk + 1] = (int16_t)hi;
            bs[blk] = (int16_t)(lo + hi);
        }
    }
}

static inline int32_t four_bytes(const int8_t *p) {  /* 4 activation bytes as one int32 */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Two blocks' activation sums, bs[0] and bs[1], as the int16 pair of an int32 (bs[0] low),
 * for vpmaddwd / vpdpwssd against the pairs of the blocks' mins: read straight from memory, so
 * its broadcast is a load, not a pair built in general registers and moved across (the mins
 * term is ~14% of a many-row pass on Zen 4; this form timed 0.88-1.04x the built pairs). */
static inline int32_t bs_pair(const int16_t *bs) { return four_bytes((const int8_t *)bs); }

/* ---- lanes kinds: one tile of 16 outputs × nr rows ---- */

typedef struct {  /* one tile's weights (see the layout above) */
    const uint8_t *qs, *qh;
    const void *sc;      /* K: uint8 [nb, 16]; S6: int8 [nb, 2, 16]; B: unused */
    const int8_t *mins;  /* K: [nb, 16] */
    const void *dsup;    /* K, S6: float [nw, 16]; B: float16 [nb, 16] (d) */
    const void *dmin;    /* K: float [nw, 16]; B: float16 [nb, 16] (m) or NULL */
} lanes_t;

#if QM_AVX512
/* The 2-bit field g of every byte of `h` moved to bits 4-5 (other bits: garbage, masked by the
 * caller with 0x30; the shifts run in 16-bit lanes, whose bits crossing a byte land outside
 * 4-5). */
static inline __m512i field_to_top(__m512i h, int g) {
    return g == 0 ? _mm512_slli_epi16(h, 4) : g == 1 ? _mm512_slli_epi16(h, 2)
                                            : g == 2 ? h : _mm512_srli_epi16(h, 2);
}

/* acc += vpdpbusd(w, the 4 bytes at p in every lane): the broadcast folded into the
 * instruction's memory operand ({1to16}), which GCC does not do from _mm512_set1_epi32 (it
 * emits a vpbroadcastd per row and step). A macro, not a function: through an inline
 * function's copy GCC spilled the rows' sums (many-row passes 1.1-1.3x the time). Zen 4,
 * alternated: 4-bit passes of 4-32 rows 0.93-0.96x the time, 6-bit 0.88-0.94x. */
#define DPBUSD_AT(acc, w, p) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))

/* yt [nr, 16] for rows 0..nr (qa, da, bs, bh: row 0's, strides k, k/ab, nb, 2nb); `kind` and
 * nr ≤ LR_OF(kind) are constants after inlining. */
static inline __attribute__((always_inline)) void lanes_rows(
    int kind, const lanes_t *w, int64_t k, int64_t wsb, int64_t ab, int32_t zero,
    const int8_t *qa, const float *da, const int16_t *bs, const int16_t *bh, int nr, float *yt) {
    const int bits = CODE_BITS(kind), split = kind == KIND_S6, fb = FLOAT_BLOCKS(kind);
    const int64_t nb = k / QK, nab = k / ab, g = fb ? QK : wsb < ab ? wsb : ab, per = g / QK;
    const int64_t qbytes = bits == 8 ? 512 : 256;
    const __m512i mask = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    /* y (each row's 16 outputs) lives in yt, updated once per step: the registers go to the
     * rows' integer sums */
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(yt + r * TILE, _mm512_setzero_ps());
    for (int64_t c0 = 0; c0 < nb; c0 += per) {  /* one step: blocks c0 .. c0 + per */
        const int64_t act = c0 * QK / ab;  /* the step's activation block */
        __m512i isum[LR];
        for (int r = 0; r < nr; r++) isum[r] = _mm512_setzero_si512();
        for (int64_t b = c0; b < c0 + per; b++) {
            const uint8_t *q = w->qs + b * qbytes;
            __m512i acc[LR], acc2[LR];  /* acc2: S6's second half (inputs 16..31) */
            for (int r = 0; r < nr; r++) acc[r] = acc2[r] = _mm512_setzero_si512();
            if (bits == 8) {
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    FETCH_LANES(q + 64 * c + PREFETCH, nr);
                    const __m512i wv = _mm512_loadu_si512((const void *)(q + 64 * c));
                    for (int r = 0; r < nr; r++) DPBUSD_AT(acc[r], wv, qa + r * k + b * QK + 4 * c);
                }
            } else {
                __m512i h0 = _mm512_setzero_si512(), h1 = h0;
                if (bits == 6) {
                    const uint8_t *h = w->qh + b * 128;
                    FETCH_LANES(h + PREFETCH / 2, nr);
                    FETCH_LANES(h + PREFETCH / 2 + 64, nr);
                    h0 = _mm512_loadu_si512((const void *)h);
                    h1 = _mm512_loadu_si512((const void *)(h + 64));
                }
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    FETCH_LANES(q + 64 * c + PREFETCH, nr);
                    const __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * c));
                    __m512i lo = _mm512_and_si512(packed, mask);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
                    if (bits == 6) {  /* lo | (field & 0x30) */
                        lo = _mm512_ternarylogic_epi32(lo, field_to_top(h0, c), top, 0xF8);
                        hi = _mm512_ternarylogic_epi32(hi, field_to_top(h1, c), top, 0xF8);
                    }
                    for (int r = 0; r < nr; r++) {
                        const int8_t *a = qa + r * k + b * QK + 4 * c;
                        DPBUSD_AT(acc[r], lo, a);
                        if (split) DPBUSD_AT(acc2[r], hi, a + 16);
                        else DPBUSD_AT(acc[r], hi, a + 16);
                    }
                }
            }
            if (fb) {  /* y += (Σ q·qa − zero·Σqa)·(d·da) [+ Σqa·(m·da)], block by block */
                const __m512 d = _mm512_cvtph_ps(
                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)w->dsup + b * TILE)));
                const __m512 m = w->dmin ? _mm512_cvtph_ps(_mm256_loadu_si256(
                    (const __m256i *)((const uint16_t *)w->dmin + b * TILE))) : _mm512_setzero_ps();
                for (int r = 0; r < nr; r++) {
                    const int32_t s = bs[r * nb + b];
                    const __m512i i = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(zero * s));
                    const __m512 a = _mm512_set1_ps(da[r * nab + act]);
                    __m512 y = _mm512_loadu_ps(yt + r * TILE);
                    y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(d, a), y);
                    if (w->dmin)
                        y = _mm512_fmadd_ps(_mm512_set1_ps((float)s), _mm512_mul_ps(m, a), y);
                    _mm512_storeu_ps(yt + r * TILE, y);
                }
            } else if (split) {  /* Σ_h sc_h·(Σ_h q·qa − zero·Σ_h qa) over the two halves */
                const int8_t *sc = (const int8_t *)w->sc + b * 2 * TILE;
                const __m512i slo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
                const __m512i shi =
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + TILE)));
                for (int r = 0; r < nr; r++) {
                    const int16_t *h = bh + r * 2 * nb + 2 * b;
                    const __m512i lo = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(zero * h[0]));
                    const __m512i hi = _mm512_sub_epi32(acc2[r], _mm512_set1_epi32(zero * h[1]));
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(
                        _mm512_mullo_epi32(lo, slo), _mm512_mullo_epi32(hi, shi)));
                }
            } else {
                const __m512i scale = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)((const uint8_t *)w->sc + b * TILE)));
                for (int r = 0; r < nr; r++)
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(acc[r], scale));
            }
        }
        if (fb) continue;
        const int64_t s = c0 * QK / wsb;  /* the step's weight super-block */
        const __m512 ds = _mm512_loadu_ps((const float *)w->dsup + s * TILE);
        if (split) {
            for (int r = 0; r < nr; r++) {
                const __m512 a = _mm512_set1_ps(da[r * nab + act]);
                __m512 y = _mm512_loadu_ps(yt + r * TILE);
                y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(ds, a), y);
                _mm512_storeu_ps(yt + r * TILE, y);
            }
            continue;
        }
        const __m512 dm = _mm512_loadu_ps((const float *)w->dmin + s * TILE);
        /* M = Σ_b mins_b·bs_b: lane o of pair j holds (mins of block 2j, of block 2j + 1)
         * of output o as int16 (a step of one block: 0 for the second), one vpdpwssd per pair
         * and row (exact: |M| < 2^23) */
        __m512i pairs[4];
        for (int64_t j = 0; j < (per + 1) / 2; j++) {
            const int8_t *m = w->mins + (c0 + 2 * j) * TILE;
            const __m128i lo = _mm_loadu_si128((const __m128i *)m);
            const __m128i hi = 2 * j + 1 < per ? _mm_loadu_si128((const __m128i *)(m + TILE))
                                               : _mm_setzero_si128();
            pairs[j] = _mm512_cvtepi8_epi16(
                _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
        }
        for (int r = 0; r < nr; r++) {
            __m512i msum = _mm512_setzero_si512();
            for (int64_t j = 0; j < (per + 1) / 2; j++)
                msum = _mm512_dpwssd_epi32(msum, pairs[j], _mm512_set1_epi32(
                    bs_pair(bs + r * nb + c0 + 2 * j)));
            const __m512 a = _mm512_set1_ps(da[r * nab + act]);
            __m512 y = _mm512_loadu_ps(yt + r * TILE);
            y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(ds, a), y);
            y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, a), y);
            _mm512_storeu_ps(yt + r * TILE, y);
        }
    }
}
#else
static inline __m256i field_to_top(__m256i h, int g) {  /* as the AVX-512 one */
    return g == 0 ? _mm256_slli_epi16(h, 4) : g == 1 ? _mm256_slli_epi16(h, 2)
                                            : g == 2 ? h : _mm256_srli_epi16(h, 2);
}

/* Each output's int8 field (sc of S6) as an int16 in both halves of its 32-bit lane, for
 * pmaddwd: the 8 lanes of `p`. */
static inline __m256i both_halves(const int8_t *p) {
    const __m256i v = _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                                       _mm256_set1_epi32(0xFFFF));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

/* yt [nr, 16] for rows 0..nr: per step, the tile's two halves of 8 outputs one after the
 * other (the outputs live in yt, updated once per step, as in the AVX-512 build). The second
 * half reads the step's weights from L1, so the gap in the stream that only the first half
 * fetches ahead is one step's compute, not a whole tile's. */
static inline __attribute__((always_inline)) void lanes_rows(
    int kind, const lanes_t *w, int64_t k, int64_t wsb, int64_t ab, int32_t zero,
    const int8_t *qa, const float *da, const int16_t *bs, const int16_t *bh, int nr, float *yt) {
    const int bits = CODE_BITS(kind), split = kind == KIND_S6, fb = FLOAT_BLOCKS(kind);
    const int64_t nb = k / QK, nab = k / ab, g = fb ? QK : wsb < ab ? wsb : ab, per = g / QK;
    const int64_t qbytes = bits == 8 ? 512 : 256;
    const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(yt + r * TILE, _mm256_setzero_ps());
        _mm256_storeu_ps(yt + r * TILE + 8, _mm256_setzero_ps());
    }
    for (int64_t c0 = 0; c0 < nb; c0 += per) {
        const int64_t act = c0 * QK / ab;
        for (int half = 0; half < 2; half++) {
            const int64_t at = 8 * half;  /* the half's first lane */
            __m256i isum[LR];
            for (int r = 0; r < nr; r++) isum[r] = _mm256_setzero_si256();
            for (int64_t b = c0; b < c0 + per; b++) {
                const uint8_t *q = w->qs + b * qbytes + 4 * at;
                __m256i h0 = _mm256_setzero_si256(), h1 = h0;
                if (bits == 6) {
                    const uint8_t *h = w->qh + b * 128 + 4 * at;
                    if (!half) {
                        FETCH_LANES(h + PREFETCH / 2, nr);
                        FETCH_LANES(h + PREFETCH / 2 + 64, nr);
                    }
                    h0 = _mm256_loadu_si256((const __m256i *)h);
                    h1 = _mm256_loadu_si256((const __m256i *)(h + 64));
                }
                /* K: the block's scale of each output in both 16-bit halves of its lane; S6:
                 * those of the two halves of the block; B: 1 */
                __m256i scale = ones, slo = ones, shi = ones;
                if (split) {
                    const int8_t *sc = (const int8_t *)w->sc + b * 2 * TILE + at;
                    slo = both_halves(sc), shi = both_halves(sc + TILE);
                } else if (!fb) {
                    const __m256i sc32 = _mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)((const uint8_t *)w->sc + b * TILE + at)));
                    scale = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));
                }
                /* 4 bits: 16-bit sums; 6 bits: 32-bit, already scaled; 8 bits: 32-bit Σq·qa
                 * of the signed codes u − 128 */
                __m256i acc[LR];
                for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_si256();
                if (bits == 8) {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        if (!half) FETCH_LANES(q + 64 * c + PREFETCH, nr);
                        const __m256i wv = _mm256_xor_si256(
                            _mm256_loadu_si256((const __m256i *)(q + 64 * c)), flip);
                        const __m256i aw = _mm256_abs_epi8(wv);
                        for (int r = 0; r < nr; r++) {
                            const __m256i a4 = _mm256_set1_epi32(four_bytes(qa + r * k + b * QK + 4 * c));
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a4, wv)), ones));
                        }
                    }
                } else {
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) {
                        if (!half) FETCH_LANES(q + 64 * c + PREFETCH, nr);
                        const __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 64 * c));
                        __m256i lo = _mm256_and_si256(packed, mask);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
                        if (bits == 6) {
                            lo = _mm256_or_si256(lo, _mm256_and_si256(field_to_top(h0, c), top));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(field_to_top(h1, c), top));
                        }
                        for (int r = 0; r < nr; r++) {
                            const int8_t *a = qa + r * k + b * QK + 4 * c;
                            const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(a)));
                            const __m256i phi =
                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(a + 16)));
                            if (split)
                                acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(
                                    _mm256_madd_epi16(plo, slo), _mm256_madd_epi16(phi, shi)));
                            else if (bits == 4)
                                acc[r] = _mm256_add_epi16(acc[r], _mm256_add_epi16(plo, phi));
                            else
                                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                                    _mm256_add_epi16(plo, phi), scale));
                        }
                    }
                }
                if (fb) {
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
                        (const __m128i *)((const uint16_t *)w->dsup + b * TILE + at)));
                    const __m256 m = w->dmin ? _mm256_cvtph_ps(_mm_loadu_si128(
                        (const __m128i *)((const uint16_t *)w->dmin + b * TILE + at)))
                                             : _mm256_setzero_ps();
                    for (int r = 0; r < nr; r++) {
                        const int32_t s = bs[r * nb + b];
                        /* 8 bits: the signed codes' sums already are Σ(u − zero)·qa */
                        const __m256i i = bits == 8 ? acc[r] : _mm256_sub_epi32(
                            bits == 4 ? _mm256_madd_epi16(acc[r], ones) : acc[r],
                            _mm256_set1_epi32(zero * s));
                        const __m256 a = _mm256_set1_ps(da[r * nab + act]);
                        __m256 y = _mm256_loadu_ps(yt + r * TILE + at);
                        y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, a), y);
                        if (w->dmin)
                            y = _mm256_fmadd_ps(_mm256_set1_ps((float)s), _mm256_mul_ps(m, a), y);
                        _mm256_storeu_ps(yt + r * TILE + at, y);
                    }
                } else if (split) {  /* less zero·Σ_h sc_h·Σ_h qa */
                    const int8_t *sc = (const int8_t *)w->sc + b * 2 * TILE + at;
                    const __m256i pair = _mm256_or_si256(
                        _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                                         _mm256_set1_epi32(0xFFFF)),
                        _mm256_slli_epi32(_mm256_cvtepi8_epi32(
                            _mm_loadl_epi64((const __m128i *)(sc + TILE))), 16));
                    for (int r = 0; r < nr; r++) {
                        const __m256i corr = _mm256_madd_epi16(
                            pair, _mm256_set1_epi32(bs_pair(bh + r * 2 * nb + 2 * b)));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_sub_epi32(
                            acc[r], _mm256_mullo_epi32(corr, _mm256_set1_epi32(zero))));
                    }
                } else {
                    for (int r = 0; r < nr; r++)
                        isum[r] = _mm256_add_epi32(
                            isum[r], bits == 4 ? _mm256_madd_epi16(acc[r], scale) : acc[r]);
                }
            }
            if (fb) continue;
            const int64_t s = c0 * QK / wsb;
            const __m256 ds = _mm256_loadu_ps((const float *)w->dsup + s * TILE + at);
            if (split) {
                for (int r = 0; r < nr; r++) {
                    const __m256 a = _mm256_set1_ps(da[r * nab + act]);
                    __m256 y = _mm256_loadu_ps(yt + r * TILE + at);
                    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(ds, a), y);
                    _mm256_storeu_ps(yt + r * TILE + at, y);
                }
                continue;
            }
            const __m256 dm = _mm256_loadu_ps((const float *)w->dmin + s * TILE + at);
            __m256i pairs[4];  /* as the AVX-512 build's, for the half's 8 outputs */
            for (int64_t j = 0; j < (per + 1) / 2; j++) {
                const int8_t *m = w->mins + (c0 + 2 * j) * TILE + at;
                const __m128i hi = 2 * j + 1 < per ? _mm_loadl_epi64((const __m128i *)(m + TILE))
                                                   : _mm_setzero_si128();
                pairs[j] = _mm256_cvtepi8_epi16(
                    _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)m), hi));
            }
            for (int r = 0; r < nr; r++) {
                __m256i msum = _mm256_setzero_si256();
                for (int64_t j = 0; j < (per + 1) / 2; j++)
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(
                        bs_pair(bs + r * nb + c0 + 2 * j))));
                const __m256 a = _mm256_set1_ps(da[r * nab + act]);
                __m256 y = _mm256_loadu_ps(yt + r * TILE + at);
                y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(ds, a), y);
                y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, a), y);
                _mm256_storeu_ps(yt + r * TILE + at, y);
            }
        }
    }
}
#endif

/* `kind` as a compile-time constant in each copy of lanes_rows. */
static inline __attribute__((always_inline)) void lanes_of(
    int kind, const lanes_t *w, int64_t k, int64_t wsb, int64_t ab, int32_t zero,
    const int8_t *qa, const float *da, const int16_t *bs, const int16_t *bh, int nr, float *yt) {
    switch (kind) {
    case KIND_K4: lanes_rows(KIND_K4, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    case KIND_K6: lanes_rows(KIND_K6, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    case KIND_S6: lanes_rows(KIND_S6, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    case KIND_B4: lanes_rows(KIND_B4, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    case KIND_B6: lanes_rows(KIND_B6, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    default: lanes_rows(KIND_B8, w, k, wsb, ab, zero, qa, da, bs, bh, nr, yt); break;
    }
}

#define LANES_CASE(n_) \
    case n_: lanes_of(kind, &w, k, wsb, ab, zero, a, d, s, h, n_, yt); break;

/* The quantized weights of one call (a `proj_t`'s, see below). */
typedef struct {
    int kind;
    int64_t k, n, wsb, ab;
    int32_t zero;
    const uint8_t *qs, *qh;
    const void *sc, *dsup, *mins, *dmin;
} qw_t;

/* Tile t of a lanes-kind matmul over all rows (at most LR_OF(kind) at a time, see the layout
 * above), written into y [rows, ldy]. */
static void lanes_tile(const qw_t *p, const int8_t *qa, const float *da, const int16_t *bs,
                       const int16_t *bh, int64_t rows, int64_t t, float *y, int64_t ldy) {
    const int kind = p->kind;
    const int64_t k = p->k, wsb = p->wsb, ab = p->ab, nb = k / QK, nab = k / ab;
    const int64_t nw = FLOAT_BLOCKS(kind) ? nb : k / wsb;  /* steps of dsup, dmin per tile */
    const int64_t qbytes = CODE_BITS(kind) == 8 ? 512 : 256;
    const int32_t zero = p->zero;
    const size_t step = FLOAT_BLOCKS(kind) ? 2 : 4;  /* bytes of one dsup, dmin entry */
    const int64_t scb = kind == KIND_S6 ? 2 * TILE : TILE;  /* sc bytes per block */
    const lanes_t w = {p->qs + t * nb * qbytes, CODE_BITS(kind) == 6 ? p->qh + t * nb * 128 : NULL,
                       p->sc ? (const uint8_t *)p->sc + t * nb * scb : NULL,
                       p->mins ? (const int8_t *)p->mins + t * nb * TILE : NULL,
                       (const char *)p->dsup + t * nw * TILE * step,
                       p->dmin ? (const char *)p->dmin + t * nw * TILE * step : NULL};
    const int64_t o0 = t * TILE, valid = p->n - o0 < TILE ? p->n - o0 : TILE;
    const int64_t lr = LR_OF(kind);
    float yt[LR * TILE];
    const int64_t group = rows <= lr ? lr : GROUP(kind);
    for (int64_t r = 0; r < rows; r += group) {
        const int nr = rows - r < group ? (int)(rows - r) : (int)group;
        const int8_t *a = qa + r * k;
        const float *d = da + r * nab;
        const int16_t *s = bs + r * nb, *h = bh + r * 2 * nb;
        switch (nr) {  /* constant row counts, so the accumulators live in registers */
            LANES_CASE(1) LANES_CASE(2) LANES_CASE(3) LANES_CASE(4) LANES_CASE(5)
            LANES_CASE(6) LANES_CASE(7) LANES_CASE(8)
#if LR > 9
            LANES_CASE(9)
#endif
        default: lanes_of(kind, &w, k, wsb, ab, zero, a, d, s, h, LR, yt); break;
        }
        for (int i = 0; i < nr; i++)
            memcpy(y + (r + i) * ldy + o0, yt + i * TILE, sizeof(float) * (size_t)valid);
    }
}
/* ---- 8-bit weights: rows ---- */

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

/* out[r] for rows 0..nr of one output (nr ≤ ROWS, a constant after inlining). A zmm register
 * holds a block pair: lanes 0..7 block 2p, lanes 8..15 block 2p + 1. `dat`: the rows' da
 * transposed ([ns][stride], lanes past nr readable). */
static inline __attribute__((always_inline)) void rows8(
    const int8_t *qs, const int16_t *sc, const float *dsup, int64_t k, int64_t sb,
    const int8_t *qa, const float *dat, int64_t stride, int nr, float *out) {
    const int64_t ns = k / sb, pairs = sb / (2 * QK);
    const __m512i pick =  /* bytes 0, 1 into every word of the low half, 2, 3 of the high */
        _mm512_inserti64x4(_mm512_set1_epi16(0x0100), _mm256_set1_epi16(0x0302), 1);
    __m256 mainv = _mm256_setzero_ps();  /* lane r: row r */
    float mains[ROWS] = {0};  /* the same, for 1 or 2 rows */
    for (int64_t s = 0; s < ns; s++) {
        __m512i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm512_setzero_si512();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const int8_t *q = qs + b * QK;
            _mm_prefetch((const char *)q + PREFETCH, FETCH_HINT);
            _mm_prefetch((const char *)q + PREFETCH + 64, FETCH_HINT);
            const __m512i sign = _mm512_loadu_si512((const void *)q);
            const __m512i w = _mm512_abs_epi8(sign);
            const __mmask64 neg = _mm512_movepi8_mask(sign);
            int32_t both;  /* sc[b], sc[b + 1]: broadcast, then each half picks its word */
            memcpy(&both, sc + b, 4);
            const __m512i scale = _mm512_shuffle_epi8(_mm512_set1_epi32(both), pick);
            for (int r = 0; r < nr; r++) {
                __m512i a = _mm512_loadu_si512((const void *)(qa + r * k + b * QK));
                a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
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
    _mm256_storeu_ps(out, mainv);
    if (nr <= 2)
        for (int r = 0; r < nr; r++) out[r] = mains[r];
}
#else
static inline __attribute__((always_inline)) void rows8(
    const int8_t *qs, const int16_t *sc, const float *dsup, int64_t k, int64_t sb,
    const int8_t *qa, const float *dat, int64_t stride, int nr, float *out) {
    const int64_t ns = k / sb, pairs = sb / (2 * QK);
    __m128 mainv = _mm_setzero_ps();  /* lane r: row r */
    float mains = 0.0f;  /* the same, for one row */
    for (int64_t s = 0; s < ns; s++) {
        __m256i isum[ROWS];
        for (int r = 0; r < nr; r++) isum[r] = _mm256_setzero_si256();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = s * 2 * pairs + 2 * p;  /* first block of the pair */
            const int8_t *q = qs + b * QK;
            _mm_prefetch((const char *)q + PREFETCH, FETCH_HINT);
            _mm_prefetch((const char *)q + PREFETCH + 64, FETCH_HINT);
            const __m256i sign0 = _mm256_loadu_si256((const __m256i *)q);
            const __m256i sign1 = _mm256_loadu_si256((const __m256i *)(q + QK));
            const __m256i w0 = _mm256_abs_epi8(sign0), w1 = _mm256_abs_epi8(sign1);
            const __m256i s0 = _mm256_set1_epi16(sc[b]), s1 = _mm256_set1_epi16(sc[b + 1]);
            for (int r = 0; r < nr; r++) {
                const int8_t *a = qa + r * k + b * QK;
                const __m256i a0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a), sign0);
                const __m256i a1 =
                    _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a + QK)), sign1);
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
    _mm_storeu_ps(out, mainv);
    if (nr == 1) out[0] = mains;
}
#endif

#define ROWS8_CASE(n_) case n_: rows8(wq, ws, wd, k, sb, a, d, stride, n_, out); break;

/* Rows r0..r1 of output o: groups of ROWS rows (the last one shorter), written into y.
 * `dat` [ns][stride]: the rows' super-block scales da, transposed. */
static void output_rows8(const int8_t *qs, const int16_t *sc, const float *dsup, int64_t k,
                         int64_t sb, const int8_t *qa, const float *dat, int64_t stride,
                         int64_t ldy, int64_t o, int64_t r0, int64_t r1, float *y) {
    const int64_t nb = k / QK, ns = k / sb;
    const int8_t *wq = qs + o * k;
    const int16_t *ws = sc + o * nb;
    const float *wd = dsup + o * ns;
    float out[8];
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int nr = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        const int8_t *a = qa + r * k;
        const float *d = dat + r;
        switch (nr) {  /* constant row counts, so the accumulators live in registers */
            ROWS8_CASE(1) ROWS8_CASE(2) ROWS8_CASE(3)
#if ROWS > 4
            ROWS8_CASE(4) ROWS8_CASE(5) ROWS8_CASE(6) ROWS8_CASE(7)
#endif
        default: rows8(wq, ws, wd, k, sb, a, d, stride, ROWS, out); break;
        }
        for (int i = 0; i < nr; i++) y[(r + i) * ldy + o] = out[i];
    }
}

#if QM_AVX512
/* ---- 8-bit prefill tiles (AVX-512 VNNI): TOUT outputs in the lanes × TROWS rows ----
 * The weights of TOUT outputs are first rearranged (once per call and block of outputs) so
 * that one register holds 4 consecutive inputs of each of the outputs: vpdpbusd multiplies
 * them by 4 broadcast bytes of a row's activations + 128 and sums each group of 4 into its
 * output's lane; less 128·Σq, a block is exact, scaled once by the outputs' block scales and
 * summed exactly over the super-block in 64 bits. The float steps are the decode loop's, lane
 * by lane. Rows past the last full tile and outputs past the last full TOUT take the decode
 * loop. */
#define TOUT 16
#define TROWS 6

typedef struct {
    int8_t *w;       /* [nb][8][16][4] weight bytes */
    int32_t *sc;     /* [nb][16] block scales */
    int32_t *wsum;   /* [nb][16] 128·Σq of the block (for the +128 activations) */
    float *dsup;     /* [ns][16] */
} packed_t;

static void pack_outputs8(const int8_t *qs, const int16_t *sc, const float *dsup, int64_t k,
                          int64_t sb, int64_t o0, packed_t *pk) {
    const int64_t nb = k / QK, ns = k / sb;
    for (int o = 0; o < TOUT; o++) {
        const int64_t out = o0 + o;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *src = qs + out * k + b * QK;
            int32_t sum = 0;
            for (int i = 0; i < QK; i++) sum += src[i];
            pk->wsum[b * TOUT + o] = 128 * sum;
            for (int g = 0; g < 8; g++)
                memcpy(pk->w + ((b * 8 + g) * TOUT + o) * 4, src + 4 * g, 4);
            pk->sc[b * TOUT + o] = sc[out * nb + b];
        }
        for (int64_t s = 0; s < ns; s++) pk->dsup[s * TOUT + o] = dsup[out * ns + s];
    }
}

/* y[r, o0..o0 + 16] (row stride ldy) for TROWS rows from `a` (the activations + 128). */
static void tile_rows8(const packed_t *pk, int64_t k, int64_t sb, const int8_t *a,
                       const float *da, int64_t ldy, float *y) {
    const int64_t ns = k / sb, per = sb / QK;
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
                for (int r = 0; r < TROWS; r++)
                    t[r] = _mm512_dpbusd_epi32(
                        t[r], _mm512_set1_epi32(four_bytes(a + r * k + b * QK + 4 * g)), w);
            }
            const __m512i scale = _mm512_loadu_si512((const void *)(pk->sc + b * TOUT));
            const __m512i bias = _mm512_loadu_si512((const void *)(pk->wsum + b * TOUT));
            for (int r = 0; r < TROWS; r++) {
                const __m512i prod = _mm512_mullo_epi32(_mm512_sub_epi32(t[r], bias), scale);
                const __m256i low = _mm512_castsi512_si256(prod);
                const __m256i high = _mm512_extracti64x4_epi64(prod, 1);
                lo[r] = _mm512_add_epi64(lo[r], _mm512_cvtepi32_epi64(low));
                hi[r] = _mm512_add_epi64(hi[r], _mm512_cvtepi32_epi64(high));
            }
        }
        const __m512 ds = _mm512_loadu_ps(pk->dsup + s * TOUT);
        for (int r = 0; r < TROWS; r++) {
            const __m512 isum = _mm512_insertf32x8(
                _mm512_castps256_ps512(_mm512_cvtepi64_ps(lo[r])), _mm512_cvtepi64_ps(hi[r]), 1);
            const __m512 scale = _mm512_mul_ps(ds, _mm512_set1_ps(da[r * ns + s]));
            main[r] = _mm512_fmadd_ps(isum, scale, main[r]);
        }
    }
    for (int r = 0; r < TROWS; r++) _mm512_storeu_ps(y + r * ldy, main[r]);
}
#endif

/* output o, rows r0..r1 of an 8-bit matmul through the decode loop */
#define OUTPUT_ROWS8(o, r0, r1) \
    output_rows8((const int8_t *)qs, sc16, dsup, k, sb, qa, dat, stride, ldy, o, r0, r1, y)

/* 8-bit weights, inside the parallel region of q_matmul (qa, da, dat ready). */
static int matmul8(const uint8_t *qs, const int16_t *sc16, const float *dsup, int64_t k,
                   int64_t sb, const int8_t *qa, const int8_t *qu, const float *da,
                   const float *dat, int64_t stride, int64_t rows, int64_t n, float *y,
                   int64_t ldy, int path) {
    const int64_t nb = k / QK, ns = k / sb;
    (void)nb, (void)ns, (void)qu, (void)da;
    int failed = 0;
    if (path == 1) {
#pragma omp for schedule(static)
        for (int64_t o = 0; o < n; o++) OUTPUT_ROWS8(o, 0, rows);
        return 0;
    }
#if QM_AVX512
    packed_t pk = {aligned_alloc(64, (size_t)(nb * 8 * TOUT * 4)),
                   aligned_alloc(64, (size_t)(nb * TOUT * 4)),
                   aligned_alloc(64, (size_t)(nb * TOUT * 4)),
                   aligned_alloc(64, (size_t)(ns * TOUT * 4 + 64))};
    const int ok = pk.w && pk.sc && pk.wsum && pk.dsup;
    failed = !ok;
    const int64_t full_rows = rows / TROWS * TROWS, blocks = full_rows ? n / TOUT : 0;
#pragma omp for schedule(static)
    for (int64_t ob = 0; ob < blocks; ob++) {
        if (!ok) continue;
        const int64_t o0 = ob * TOUT;
        pack_outputs8((const int8_t *)qs, sc16, dsup, k, sb, o0, &pk);
        for (int64_t r = 0; r < full_rows; r += TROWS)
            tile_rows8(&pk, k, sb, qu + r * k, da + r * ns, ldy, y + r * ldy + o0);
        for (int64_t o = o0; o < o0 + TOUT; o++)  /* the rows left over */
            OUTPUT_ROWS8(o, full_rows, rows);
    }
#pragma omp for schedule(static)
    for (int64_t o = blocks * TOUT; o < n; o++)  /* the outputs left over */
        OUTPUT_ROWS8(o, 0, rows);
    free(pk.w), free(pk.sc), free(pk.wsum), free(pk.dsup);
#else
    int64_t row_block = ROW_BYTES / (k > 0 ? k : 1) / ROWS * ROWS;
    row_block = row_block < ROWS ? ROWS : row_block;
    const int64_t blocks = (n + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for schedule(static)
    for (int64_t ob = 0; ob < blocks; ob++) {
        const int64_t o0 = ob * OUT_BLOCK, o1 = o0 + OUT_BLOCK < n ? o0 + OUT_BLOCK : n;
        for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
            const int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows;
            for (int64_t o = o0; o < o1; o++) OUTPUT_ROWS8(o, r0, r1);
        }
    }
#endif
    return failed;
}

/* The quantized activations of one call, shared by the threads of its team. */
typedef struct {
    int8_t *qa, *qu;  /* [rows, k]: int8; + 128 (8-bit prefill tiles only, else NULL) */
    float *da, *dat;  /* [rows, k/ab]; transposed [k/ab, stride] (8-bit rows only, else NULL) */
    int16_t *bs, *bh; /* [rows, nb], [rows, 2·nb]: Σqa per block, per half block */
    int64_t stride;
    int no_memory;
} act_t;

static act_t act_alloc(int lanes, int tiles8, int64_t rows, int64_t k, int64_t nab, int64_t nb) {
    act_t a;
    const size_t act_bytes = ((size_t)(rows * k) + 63) / 64 * 64 + 64;
    a.qa = aligned_alloc(64, act_bytes);
    a.qu = tiles8 ? aligned_alloc(64, act_bytes) : NULL;
    a.da = malloc(sizeof(float) * (size_t)(rows * nab + 1));
    a.bs = malloc(sizeof(int16_t) * (size_t)(rows * nb + 2));
    a.bh = malloc(sizeof(int16_t) * (size_t)(rows * 2 * nb + 2));
    a.stride = (rows + 7) / 8 * 8 + 8;  /* rows of dat, padded: 8 lanes read */
    a.dat = lanes ? NULL : calloc((size_t)(nab * a.stride), sizeof(float));
    a.no_memory = !a.qa || !a.da || !a.bs || !a.bh || (!lanes && !a.dat) || (tiles8 && !a.qu);
    return a;
}

static void act_free(act_t *a) {
    free(a->qa), free(a->qu), free(a->da), free(a->bs), free(a->bh), free(a->dat);
}

static int pow2_block(int64_t v) { return v == 32 || v == 64 || v == 128 || v == 256; }

/* Whether the weights `p` (and rows, path) are something q_matmul_team cannot run: the fields
 * each kind takes (see the layouts above), block sizes dividing k. */
static int q_args_bad(const qw_t *p, int64_t rows, int path) {
    const int kind = p->kind, lanes = LANES_KIND(kind);
    if (!lanes && kind != KIND_R8) return 1;
    if (rows < 0 || p->n < 0 || p->k < 0 || path < 0 || path > 2 || !pow2_block(p->ab) ||
        !pow2_block(p->wsb) || p->k % p->ab || p->k % p->wsb)
        return 1;
    const int six = lanes && CODE_BITS(kind) == 6;
    if (six != (p->qh != NULL)) return 1;
    switch (kind) {
    case KIND_K4: case KIND_K6:
        return p->wsb < 2 * QK || !p->sc || !p->mins || !p->dmin || p->zero != 0;
    case KIND_S6:
        return !p->sc || p->mins || p->dmin || p->zero < 0 || p->zero > 63;
    case KIND_B4: case KIND_B6: case KIND_B8:
        return p->wsb != QK || p->sc || p->mins ||
               (kind == KIND_B8 ? p->zero != 128 : p->zero < 0 || p->zero > 63);
    default:  /* KIND_R8 */
        return p->wsb < 2 * QK || p->ab != p->wsb || !p->sc || p->mins || p->dmin || p->zero;
    }
}

/* Lanes kinds: the rows one sweep over the tiles takes. A tile's weights (k/32 blocks of 256
 * bytes: 12 KB at k = 1536) stay in L2 while every group of rows passes over them, but the
 * rows' activations stream past once per tile, each byte read by a broadcast of the
 * multiply-adds. So a long pass sweeps the tiles once per block of rows whose activations fit
 * in LANE_ROW_BYTES, about an L1 data cache (whole groups of rows). The weights are read once
 * per block instead, from memory: at 30 rows, ~0.6 byte per weight is 1/50 of a byte per
 * multiply-add, far below what the loop asks of L1. On a Sapphire Rapids class Xeon (48 KB
 * L1d), 256 rows of 1536 inputs took 0.57-0.58x the time with 48 KB blocks as with 256 KB
 * ones (AVX-512 build; AVX2 0.90x); 24 and 96 KB blocks timed as 48 KB, 128 KB ones 1.7x. A
 * pass of up to LR_OF(kind) rows is one block. A row's bits do not depend on its block. */
static int64_t lane_row_block(int kind, int64_t k) {
    const int64_t group = GROUP(kind), fit = LANE_ROW_BYTES / k / group * group;
    return fit > LR_OF(kind) ? fit : LR_OF(kind);
}

/* q_matmul's work, called by every thread of an enclosing parallel region (its loops are
 * orphaned `omp for`s that share the work out, each ending at a barrier); the activations'
 * buffers are allocated once for the team. Arguments already checked. Returns 0, or 1 when
 * out of memory (the same on every thread, but for the 8-bit tiles' own buffers). */
static int q_matmul_team(const qw_t *p, const float *x, int64_t rows, float *y, int64_t ldy,
                         int path) {
    const int lanes = LANES_KIND(p->kind);
    const int64_t k = p->k, n = p->n, nb = k / QK, nab = k / p->ab;
    if (path == 0) path = rows >= PREFILL_ROWS ? 2 : 1;
    const int tiles8 = QM_AVX512 && !lanes && path == 2;
    act_t a;
#pragma omp single copyprivate(a)
    a = act_alloc(lanes, tiles8, rows, k, nab, nb);
    int failed = a.no_memory;
    if (!a.no_memory) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            quantize_row(x + r * k, k, p->ab, a.qa + r * k, a.da + r * nab, a.bs + r * nb,
                         a.bh + r * 2 * nb);
            if (a.dat)
                for (int64_t j = 0; j < nab; j++) a.dat[j * a.stride + r] = a.da[r * nab + j];
            if (a.qu)  /* the activations + 128, unsigned, for vpdpbusd against signed weights */
                for (int64_t i = 0; i < k; i++) a.qu[r * k + i] = (int8_t)(a.qa[r * k + i] ^ 0x80);
        }
        if (lanes) {
            const int64_t tiles = (n + TILE - 1) / TILE, block = lane_row_block(p->kind, k);
            for (int64_t r0 = 0; r0 < rows; r0 += block) {  /* one block for a decode, a verify */
                const int64_t nr = rows - r0 < block ? rows - r0 : block;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < tiles; t++)
                    lanes_tile(p, a.qa + r0 * k, a.da + r0 * nab, a.bs + r0 * nb,
                               a.bh + r0 * 2 * nb, nr, t, y + r0 * ldy, ldy);
            }
        } else {
            failed = matmul8(p->qs, (const int16_t *)p->sc, (const float *)p->dsup, k, p->wsb,
                             a.qa, a.qu, a.da, a.dat, a.stride, rows, n, y, ldy, path);
        }
    }
#pragma omp single nowait  /* every thread is past the last loop's barrier */
    act_free(&a);
    return failed;
}

/* y [rows, ldy] (its first n columns) = x [rows, k] · Wᵀ with quantized weights of `kind`
 * (layouts above): sb the weights' step block (wsb), ab the activations' block, zero the
 * codes' offset (S6, B kinds). `path` (8-bit rows): 1 walks the outputs one by one, each
 * over all rows (decode, verify); 2 walks blocks of outputs × blocks of rows (prefill: the
 * tiles on AVX-512); 0 picks by the number of rows (PREFILL_ROWS); the lanes kinds have one
 * loop for every path. Every path gives the same bits per row. Returns 0, −1 when out of
 * memory, −2 on bad arguments. */
int q_matmul(int kind, const float *x, int64_t rows, int64_t k, int64_t sb, int64_t ab,
             int32_t zero, const uint8_t *qs, const uint8_t *qh, const void *sc,
             const void *dsup, const void *mins, const void *dmin, int64_t n, float *y,
             int64_t ldy, int path) {
    const qw_t p = {kind, k, n, sb, ab, zero, qs, qh, sc, dsup, mins, dmin};
    if (q_args_bad(&p, rows, path) || ldy < n || !qs || !dsup) return -2;
    int failed = 0;
#pragma omp parallel
    {
        if (q_matmul_team(&p, x, rows, y, ldy, path)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

int q_sc_max(int bits) { return bits == 8 ? SC_MAX8 : SC_MAX_LANES; }

/* 2: the AVX-512 VNNI build, 1: the AVX2 build. */
int q_isa(void) { return QM_AVX512 ? 2 : 1; }

/* ---- float weights ---- */

static inline float hsum(__m256 v) {  /* a fixed horizontal sum of 8 lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* f_matmul's work, called by every thread of an enclosing parallel region (one orphaned
 * `omp for` over the tiles of outputs). */
static void f_matmul_team(const float *x, int64_t rows, int64_t k, const void *w, int bf16,
                          const float *bias, int64_t n, float *y, int64_t ldy) {
    const int64_t tiles = (n + FO - 1) / FO;
#pragma omp for schedule(static)
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
                    y[(r + i) * ldy + o0 + o] = bias ? v + bias[o0 + o] : v;
                }
        }
    }
}

/* y [rows, n] = x [rows, k] · Wᵀ (+ bias [n]), W [n, k] float32 (bf16 = 0) or bfloat16
 * (bf16 = 1, widened exactly). Returns 0, −2 on bad arguments. */
int f_matmul(const float *x, int64_t rows, int64_t k, const void *w, int bf16,
             const float *bias, int64_t n, float *y) {
    if (rows < 0 || k < 0 || n < 0 || (bf16 != 0 && bf16 != 1)) return -2;
#pragma omp parallel
    f_matmul_team(x, rows, k, w, bf16, bias, n, y, n);
    return 0;
}

/* ---- a projection: a chain of parts (the per-call path and the fused decoder pass) ---- */

/* A projection's weights: `kind` a quantized kind (q_matmul's kinds, layouts and weight
 * arguments: sb, ab, zero, qs..dmin) or 32, 16 (float32 or bfloat16 weights [n, k] at qs;
 * sb and the rest unused). A projection may be several parts, each of its own kind, chained
 * by `next`: part i writes the n_i columns after its predecessors' (the fused q/k/v of a file
 * whose value rows are stored otherwise than its query and key rows). `bias` (the chain's
 * first part's, [Σ n_i] or NULL) is added to every row after all parts; `path` is q_matmul's. */
typedef struct proj {
    int64_t kind, k, n, sb;
    const uint8_t *qs, *qh;
    const void *sc, *dsup, *mins, *dmin;
    const float *bias;
    int64_t ab, zero, path;
    const struct proj *next;
} proj_t;

static qw_t qw_of(const proj_t *p) {
    const qw_t w = {(int)p->kind, p->k, p->n, p->sb, p->ab, (int32_t)p->zero, p->qs, p->qh,
                    p->sc, p->dsup, p->mins, p->dmin};
    return w;
}

static int64_t chain_width(const proj_t *p) {
    int64_t n = 0;
    for (; p; p = p->next) n += p->n;
    return n;
}

/* 0 if `p` is a projection `proj_team` runs, −2 if not. */
int proj_check(const proj_t *p) {
    if (!p) return -2;
    const int64_t k = p->k;
    for (int parts = 0; p; p = p->next, parts++) {
        if (parts >= 64 || p->k != k || !p->qs) return -2;
        if (p->kind == 32 || p->kind == 16) {
            if (p->k < 0 || p->n < 0) return -2;
            continue;
        }
        const qw_t w = qw_of(p);
        if (q_args_bad(&w, 0, (int)p->path) || !p->dsup) return -2;
    }
    return 0;
}

/* y [rows, Σ n_i] = x [rows, k] · Wᵀ (+ bias) for a projection that passed `proj_check`,
 * called by every thread of an enclosing parallel region: each part the same bits as
 * q_matmul or f_matmul on its own. Returns 0, or 1 when out of memory. */
int proj_team(const proj_t *p, const float *x, int64_t rows, float *y) {
    const int64_t ldy = chain_width(p);
    const float *bias = p->bias;
    int failed = 0;
    for (int64_t at = 0; p; at += p->n, p = p->next) {
        if (p->kind == 32 || p->kind == 16) {
            f_matmul_team(x, rows, p->k, p->qs, p->kind == 16, NULL, p->n, y + at, ldy);
        } else {
            const qw_t w = qw_of(p);
            failed |= q_matmul_team(&w, x, rows, y + at, ldy, (int)p->path);
        }
    }
    if (bias) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < ldy; o++) y[r * ldy + o] += bias[o];
    }
    return failed;
}

/* `proj_team` in a parallel region of its own (a projection called on its own). Returns 0,
 * −1 when out of memory, −2 on bad arguments. */
int proj_run(const proj_t *p, const float *x, int64_t rows, float *y) {
    if (proj_check(p) != 0 || rows < 0) return -2;
    int failed = 0;
#pragma omp parallel
    {
        if (proj_team(p, x, rows, y)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
