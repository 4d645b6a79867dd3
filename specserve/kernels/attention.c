/* Ragged causal attention over a paged KV cache, for x86-64 CPUs with AVX2 and FMA.
 *
 * Every query row belongs to one sequence and sits at one position of it; it attends to that
 * sequence's positions 0..pos (its own key/value already written). Keys and values live in
 * pools of blocks, [num_blocks, kv_heads, block_size, hd] elements (kinds below); position p
 * of sequence s is at offset p % block_size of block block_tables[s, p / block_size].
 *
 * One work item is up to ROWS consecutive rows of one sequence × one KV head: the G query
 * heads of each row that share the KV head, so each key and value is loaded once for all of
 * them. Items run in parallel (OpenMP). Each (row, query head) has accumulators of its own, and
 * its arithmetic follows one fixed order that depends only on its query, its number of
 * positions and its keys/values — not on the other rows, how rows fall into items, the number
 * of rows, the block size, the thread count or the instruction set the file is built for. So
 * a row's output is bit-for-bit the same alone, in any batch, in any order.
 *
 * Per item, in three passes over a score buffer s [rows, G, n rounded up to 8]:
 *   scores   tiles of 8 positions (0-7, 8-15, ... whatever the block size): each query head's
 *            8 dot products accumulate over hd in 8-lane FMAs, then one fixed hadd tree turns
 *            the 8 accumulators into the tile's 8 scores (lanes past the row's end: −inf);
 *   softmax  subtract the row's maximum, e^x by range reduction and a degree-7 polynomial,
 *            sum in 8 lanes tile by tile, one fixed horizontal sum at the end;
 *   values   out[g] = Σ_p w[g, p]·v_p, p in order, in registers over 16 (or 8) columns of hd
 *            at a time for up to 6 query heads at once, then × 1/sum.
 * Positions after a row's own are never read into its result (their memory may hold stale or
 * unwritten values).
 *
 * The pools hold float32, float16 or bfloat16 elements (`kv_kind`: KV_F32, KV_F16, KV_BF16).
 * Narrow elements are widened to float32 as they are loaded (exactly: every float16 and
 * bfloat16 value is a float32 value), and all arithmetic stays float32, so attention over a
 * narrow pool gives the same bits as over a float32 pool holding the widened values. Stores
 * into a narrow pool round to nearest even, as PyTorch's `.to(torch.float16)` and
 * `.to(torch.bfloat16)` do. A float16 pool halves the bytes a decode step reads.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 8     /* positions per score tile: one vector of 8 scores */
#define GROUP 6    /* query heads whose value sums share one pass over the values */
#define ROWS 8     /* rows of one sequence per work item, sharing each key and value load */
#define PTILE 64   /* positions per value tile (kept in L1 for all rows of an item) */
#define AHEAD 16   /* positions whose keys are prefetched ahead of the score tile */
/* Prefetches are inline assembly: GCC finds a small function whose only statement is
 * `_mm_prefetch` free of side effects and deletes the calls it did not inline early (so no
 * prefetch was ever issued here before). */

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define AT_AVX512 1 /* two keys (scores) or 16 columns (values) per register; each
                     * lane's arithmetic is the 8-lane build's, so the bits are the same */
#else
#define AT_AVX512 0
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };  /* element kinds of the KV pools */

static inline int64_t kv_size(int kind) { return kind == KV_F32 ? 4 : 2; }

/* 8 elements of a pool from element index i, widened to float32; kind is a constant in each
 * inlined copy, so a float32 pool's load is the plain load it always was. */
static inline __attribute__((always_inline)) __m256 kv_load(const void *pool, int64_t i,
                                                            int kind) {
    if (kind == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)));
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i))), 16));
    return _mm256_loadu_ps((const float *)pool + i);
}

#if AT_AVX512
/* 16 elements from element index i, widened to float32: the values of two kv_load. */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *pool, int64_t i,
                                                              int kind) {
    if (kind == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i)));
    if (kind == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i))), 16));
    return _mm512_loadu_ps((const float *)pool + i);
}

/* 8 elements from element index i (lanes 0-7) and 8 from j (lanes 8-15), widened to float32:
 * the values of kv_load(i) and kv_load(j). */
static inline __attribute__((always_inline)) __m512 kv_load_pair(const void *pool, int64_t i,
                                                                 int64_t j, int kind) {
    if (kind == KV_F32)
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)pool + i)),
                                  _mm256_loadu_ps((const float *)pool + j), 1);
    const uint16_t *h = (const uint16_t *)pool;
    const __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(h + i))),
        _mm_loadu_si128((const __m128i *)(h + j)), 1);
    if (kind == KV_F16) return _mm512_cvtph_ps(both);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
}
#endif

/* Fetch the cache line of element i of a pool into L2 (prefetcht1; see AHEAD). Into L1 (t0),
 * the keys' and values' prefetches held L1's few miss buffers and stalled the loops behind
 * them: attention of one decode row at 2k positions ran at ~5 GB/s of the cache per thread.
 * With t1 (Zen 4, alternated, same outputs): one row at 512 / 2048 / 4096 positions 0.80 /
 * 0.60-0.63 / 0.61x the time, 9 rows at 1k 0.90x, 64 rows at 2k 0.97x; 16 positions ahead
 * was as fast as 32 or 64. */
static inline void kv_prefetch(const void *pool, int64_t i, int kind) {
    const char *at = (const char *)pool + i * kv_size(kind);
    __asm__ volatile("prefetcht1 %0" : : "m"(*at));
}

/* Fetch every cache line of positions p..min(end, nmax) − 1 (element offsets off[p]). */
static inline void kv_prefetch_span(const void *pool, const int64_t *off, int64_t p,
                                    int64_t end, int64_t nmax, int64_t hd, int kind) {
    const int64_t line = 64 / kv_size(kind);  /* elements per cache line */
    for (; p < end && p < nmax; p++)
        for (int64_t j = 0; j < hd; j += line) kv_prefetch(pool, off[p] + j, kind);
}

/* float32 → bfloat16, nearest even; NaN → the quiet NaN 0x7FC0 (as PyTorch rounds). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* pool[at : at + hd] = x [hd] (hd a multiple of 8), rounded to the pool's kind. */
static inline void kv_store(void *pool, int64_t at, const float *x, int64_t hd, int kind) {
    if (kind == KV_F32) {
        memcpy((float *)pool + at, x, (size_t)hd * sizeof(float));
    } else if (kind == KV_F16) {
        uint16_t *dst = (uint16_t *)pool + at;
        for (int64_t j = 0; j < hd; j += 8)
            _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(
                _mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        uint16_t *dst = (uint16_t *)pool + at;
        for (int64_t j = 0; j < hd; j++) dst[j] = to_bf16(x[j]);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane t of the result = the sum of the 8 lanes of a[t]. */
static inline __m256 hsum8x8(const __m256 a[TILE]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x for x ≤ 0; lanes below −87 (−inf included) give 0. x = n·ln2 + r with |r| ≤ ln2/2
 * (ln2 split in two for an exact product), e^r by its Taylor series to r^7 (error < 1e-8). */
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lowest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}


/* s [m, G, np] = qs [m, G, hd] · keysᵀ (qs already scaled), −inf past each row's n[i]; vmax
 * [m, G] ← lane-wise maxima. Each (query vector, key) score is the sum of 8 lanes (lane j:
 * the FMAs of q[8c + j]·k[8c + j] over the chunks c of hd in order, from zero) by one fixed
 * tree (hsum8x8): the AVX-512 build holds two keys' 8 lanes in one register, the AVX2 build
 * one, so both give the same bits. */
#if AT_AVX512
#define QB 6 /* query vectors per pass over a tile's keys (6 × 4 accumulators of 32) */

/* acc[v][pr] for nq ≤ QB query vectors q [nq, hd] (nq a constant after inlining) × the
 * tile's keys in pairs, kt [TILE / 2, hd / 8, 16] (key 2pr's chunk c in lanes 0-7, key
 * 2pr + 1's in lanes 8-15): each key pair is loaded once for the nq vectors. */
static inline __attribute__((always_inline)) void score_block(int nq, const float *q,
                                                              int64_t hd, const float *kt,
                                                              __m512 acc[QB][TILE / 2]) {
    const int64_t chunks = hd / 8;
    for (int v = 0; v < nq; v++)
        for (int pr = 0; pr < TILE / 2; pr++) acc[v][pr] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512 kk[TILE / 2];
        for (int pr = 0; pr < TILE / 2; pr++) kk[pr] = _mm512_loadu_ps(kt + (pr * chunks + c) * 16);
        for (int v = 0; v < nq; v++) {
            const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + v * hd + 8 * c));
            for (int pr = 0; pr < TILE / 2; pr++)
                acc[v][pr] = _mm512_fmadd_ps(qv, kk[pr], acc[v][pr]);
        }
    }
}

static inline __attribute__((always_inline)) void scores(
    int m, int G, int64_t hd, const int64_t *n, int64_t nmax, int64_t np, const float *qs,
    const void *kp, int kind, const int64_t *off, float *s, __m256 *vmax, float *kt) {
    const int64_t chunks = hd / 8;
    const int nvec = m * G;
    for (int j = 0; j < nvec; j++) vmax[j] = _mm256_set1_ps(-INFINITY);
    kv_prefetch_span(kp, off, 0, AHEAD, nmax, hd, kind);  /* the first tiles' keys */
    for (int64_t p0 = 0; p0 < nmax; p0 += TILE) {
        kv_prefetch_span(kp, off, p0 + AHEAD, p0 + AHEAD + TILE, nmax, hd, kind);
        /* the tile's keys widened into pairs (positions past nmax: the last one) */
        for (int pr = 0; pr < TILE / 2; pr++) {
            const int64_t t0 = p0 + 2 * pr, t1 = t0 + 1;
            const int64_t k0 = off[t0 < nmax ? t0 : nmax - 1], k1 = off[t1 < nmax ? t1 : nmax - 1];
            for (int64_t c = 0; c < chunks; c++)
                _mm512_storeu_ps(kt + (pr * chunks + c) * 16,
                                 kv_load_pair(kp, k0 + 8 * c, k1 + 8 * c, kind));
        }
        for (int v0 = 0; v0 < nvec; v0 += QB) {
            const int nq = nvec - v0 < QB ? nvec - v0 : QB;
            const float *q = qs + (int64_t)v0 * hd;
            __m512 acc[QB][TILE / 2];
            switch (nq) {  /* constant counts: the accumulators stay in registers */
            case 1: score_block(1, q, hd, kt, acc); break;
            case 2: score_block(2, q, hd, kt, acc); break;
            case 3: score_block(3, q, hd, kt, acc); break;
            case 4: score_block(4, q, hd, kt, acc); break;
            case 5: score_block(5, q, hd, kt, acc); break;
            default: score_block(QB, q, hd, kt, acc); break;
            }
            for (int v = 0; v < nq; v++) {
                const int64_t idx = v0 + v, i = idx / G;
                if (p0 >= n[i]) continue;  /* a row's last tile ends before nmax's */
                const int valid = n[i] - p0 < TILE ? (int)(n[i] - p0) : TILE;
                const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                                  _mm256_set1_ps((float)valid), _CMP_LT_OQ);
                __m256 keys[TILE];  /* each key's 8 lanes */
                for (int pr = 0; pr < TILE / 2; pr++) {
                    keys[2 * pr] = _mm512_castps512_ps256(acc[v][pr]);
                    keys[2 * pr + 1] = _mm512_extractf32x8_ps(acc[v][pr], 1);
                }
                const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), hsum8x8(keys), live);
                _mm256_storeu_ps(s + idx * np + p0, sc);
                vmax[idx] = _mm256_max_ps(vmax[idx], sc);
            }
        }
    }
}
#else
static inline __attribute__((always_inline)) void scores(
    int m, int G, int64_t hd, const int64_t *n, int64_t nmax, int64_t np, const float *qs,
    const void *kp, int kind, const int64_t *off, float *s, __m256 *vmax, float *kt) {
    for (int j = 0; j < m * G; j++) vmax[j] = _mm256_set1_ps(-INFINITY);
    kv_prefetch_span(kp, off, 0, AHEAD, nmax, hd, kind);  /* the first tiles' keys */
    for (int64_t p0 = 0; p0 < nmax; p0 += TILE) {
        int64_t k[TILE];  /* element index of each key of the tile */
        for (int t = 0; t < TILE; t++) k[t] = off[p0 + t < nmax ? p0 + t : nmax - 1];
        kv_prefetch_span(kp, off, p0 + AHEAD, p0 + AHEAD + TILE, nmax, hd, kind);
        /* the tile's keys as float32 rows: a float32 pool's own, else widened once into kt
         * for all m·G query vectors instead of once per vector */
        const float *key[TILE];
        for (int t = 0; t < TILE; t++) {
            if (kind == KV_F32) {
                key[t] = (const float *)kp + k[t];
                continue;
            }
            for (int64_t j = 0; j < hd; j += 8)
                _mm256_storeu_ps(kt + t * hd + j, kv_load(kp, k[t] + j, kind));
            key[t] = kt + t * hd;
        }
        for (int i = 0; i < m; i++) {
            if (p0 >= n[i]) continue;
            const int valid = n[i] - p0 < TILE ? (int)(n[i] - p0) : TILE;
            const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                              _mm256_set1_ps((float)valid), _CMP_LT_OQ);
            for (int g = 0; g < G; g++) {
                const int64_t idx = (int64_t)i * G + g;
                const float *qg = qs + idx * hd;
                __m256 acc[TILE];
                for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
                for (int64_t j = 0; j < hd; j += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + j);
                    for (int t = 0; t < TILE; t++)
                        acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[t] + j), acc[t]);
                }
                const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), hsum8x8(acc), live);
                _mm256_storeu_ps(s + idx * np + p0, sc);
                vmax[idx] = _mm256_max_ps(vmax[idx], sc);
            }
        }
    }
}
#endif

/* s [m, G, np] ← e^(s − max) in place over each row's tiles; inv [m, G] ← 1 / Σ. */
static void softmax(int m, int G, const int64_t *n, int64_t np, float *s, const __m256 *vmax,
                    float *inv) {
    for (int64_t idx = 0; idx < (int64_t)m * G; idx++) {
        const int64_t npi = (n[idx / G] + TILE - 1) / TILE * TILE;
        const __m256 mx = _mm256_set1_ps(hmax(vmax[idx]));
        float *si = s + idx * np;
        __m256 sum = _mm256_setzero_ps();
        for (int64_t p0 = 0; p0 < npi; p0 += TILE) {
            const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(si + p0), mx));
            _mm256_storeu_ps(si + p0, e);
            sum = _mm256_add_ps(sum, e);
        }
        inv[idx] = 1.0f / hsum(sum);
    }
}

/* o[g, c : c + 8·nv] (+)= Σ_{p0 ≤ p < p1} w[g, p]·v_p[c : c + 8·nv] for gb ≤ GROUP heads,
 * starting from zero at p0 = 0 and from the partial sums already in `o` after; gb and nv are
 * constants in each inlined copy, so the gb·nv accumulators stay in registers. */
static inline __attribute__((always_inline)) void values_block(
    int gb, int nv, const float *w, int64_t np, const void *vp, int kind, const int64_t *off,
    int64_t p0, int64_t p1, int64_t c, float *o, int64_t hd) {
    __m256 acc[GROUP][2];
    for (int g = 0; g < gb; g++)
        for (int i = 0; i < nv; i++)
            acc[g][i] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + g * hd + c + 8 * i);
    for (int64_t p = p0; p < p1; p++) {
        __m256 vv[2];
        for (int i = 0; i < nv; i++) vv[i] = kv_load(vp, off[p] + c + 8 * i, kind);
        for (int g = 0; g < gb; g++) {
            const __m256 wg = _mm256_broadcast_ss(w + g * np + p);
            for (int i = 0; i < nv; i++) acc[g][i] = _mm256_fmadd_ps(wg, vv[i], acc[g][i]);
        }
    }
    for (int g = 0; g < gb; g++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(o + g * hd + c + 8 * i, acc[g][i]);
}

#if AT_AVX512
/* values_block for 16 columns in one register per head: the same FMAs lane by lane. */
static inline __attribute__((always_inline)) void values_block16(
    int gb, const float *w, int64_t np, const void *vp, int kind, const int64_t *off,
    int64_t p0, int64_t p1, int64_t c, float *o, int64_t hd) {
    __m512 acc[GROUP];
    for (int g = 0; g < gb; g++)
        acc[g] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + g * hd + c);
    for (int64_t p = p0; p < p1; p++) {
        const __m512 vv = kv_load16(vp, off[p] + c, kind);
        for (int g = 0; g < gb; g++)
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * np + p]), vv, acc[g]);
    }
    for (int g = 0; g < gb; g++) _mm512_storeu_ps(o + g * hd + c, acc[g]);
}
#endif

static inline __attribute__((always_inline)) void values_nv(
    int gb, int nv, const float *w, int64_t np, const void *vp, int kind, const int64_t *off,
    int64_t p0, int64_t p1, int64_t c, float *o, int64_t hd) {
#if AT_AVX512
    if (nv == 2) values_block16(gb, w, np, vp, kind, off, p0, p1, c, o, hd);
#else
    if (nv == 2) values_block(gb, 2, w, np, vp, kind, off, p0, p1, c, o, hd);
#endif
    else values_block(gb, 1, w, np, vp, kind, off, p0, p1, c, o, hd);
}

/* out[i] [G, hd] = inv · Σ_p w·v_p for each row i: positions in tiles of PTILE (the next
 * tile prefetched) that stay in L1 for all m rows, columns of hd 16 at a time, up to GROUP
 * heads per pass. For every output element the sum runs over p in order, so the tiling never
 * changes a bit. */
static inline __attribute__((always_inline)) void values(
    int m, int G, int64_t hd, const int64_t *n, int64_t nmax, int64_t np, const float *w,
    const float *inv, const void *vp, int kind, const int64_t *off, float *const *out) {
    const int passes = (G + GROUP - 1) / GROUP, per = (G + passes - 1) / passes;
    /* the next tile's values are fetched a share per column chunk, not all at once */
    const int64_t share = (PTILE + (hd + 15) / 16 - 1) / ((hd + 15) / 16);
    kv_prefetch_span(vp, off, 0, PTILE, nmax, hd, kind);  /* the first tile */
    for (int64_t p0 = 0; p0 < nmax; p0 += PTILE) {
        for (int64_t c = 0; c < hd; c += 16) {
            const int64_t a0 = p0 + PTILE + c / 16 * share, a1 = a0 + share;
            kv_prefetch_span(vp, off, a0, a1 < p0 + 2 * PTILE ? a1 : p0 + 2 * PTILE, nmax, hd,
                             kind);
            const int nv = hd - c >= 16 ? 2 : 1;
            for (int i = 0; i < m; i++) {
                if (p0 >= n[i]) continue;
                const int64_t p1 = n[i] < p0 + PTILE ? n[i] : p0 + PTILE;
                for (int g0 = 0; g0 < G; g0 += per) {
                    const int gb = G - g0 < per ? G - g0 : per;
                    const float *wg = w + ((int64_t)i * G + g0) * np;
                    float *o = out[i] + g0 * hd;
                    switch (gb) {  /* constant head counts: accumulators in registers */
                    case 1: values_nv(1, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    case 2: values_nv(2, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    case 3: values_nv(3, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    case 4: values_nv(4, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    case 5: values_nv(5, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    default: values_nv(6, nv, wg, np, vp, kind, off, p0, p1, c, o, hd); break;
                    }
                }
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            const float f = inv[i * G + g];
            float *o = out[i] + g * hd;
            for (int64_t j = 0; j < hd; j++) o[j] *= f;
        }
}

/* Where each row of a pass reads and writes the cache: the pools' element kind and geometry,
 * and each row's sequence and position (see ragged_attention). */
typedef struct {
    int64_t kv_kind, num_blocks, block_size;
    const int32_t *block_tables;  /* [num_seqs, max_blocks] */
    int64_t num_seqs, max_blocks;
    const int32_t *row_seq, *row_pos;  /* [rows] */
} kv_index_t;

/* 0, or −3 if a row's sequence or position, or a block id its positions reach, is out of
 * range; *max_n: the most positions a row attends to. */
static int check_rows(const kv_index_t *ix, int64_t rows, int64_t *max_n) {
    *max_n = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t s = ix->row_seq[r], pos = ix->row_pos[r];
        if (s < 0 || s >= ix->num_seqs || pos < 0 || pos >= ix->max_blocks * ix->block_size)
            return -3;
        for (int64_t b = 0; b <= pos / ix->block_size; b++) {
            const int64_t id = ix->block_tables[s * ix->max_blocks + b];
            if (id < 0 || id >= ix->num_blocks) return -3;
        }
        if (pos + 1 > *max_n) *max_n = pos + 1;
    }
    return 0;
}

static int bad_shape(int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                     const kv_index_t *ix) {
    return rows < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || hd <= 0 || hd % 8 ||
           ix->block_size <= 0 || ix->num_blocks < 0 || ix->num_seqs < 0 || ix->max_blocks < 0 ||
           ix->kv_kind < KV_F32 || ix->kv_kind > KV_BF16;
}

/* A pass's work items: up to ROWS consecutive rows of one sequence (they share its keys and
 * values) × one KV head. first [groups + 1]: each group's first row. */
typedef struct {
    int64_t *first, groups, max_np;
} items_t;

static int make_items(const int32_t *row_seq, int64_t rows, int64_t max_n, items_t *it) {
    it->first = malloc((size_t)(rows + 1) * sizeof(int64_t));
    if (!it->first) return -1;
    it->groups = 0;
    for (int64_t r = 0; r < rows; r++)
        if (r == 0 || row_seq[r] != row_seq[r - 1] || r - it->first[it->groups - 1] == ROWS)
            it->first[it->groups++] = r;
    it->first[it->groups] = rows;
    it->max_np = (max_n + TILE - 1) / TILE * TILE;
    return 0;
}

/* What every entry point checks before it writes anything, then its work items: 0 (`its`
 * set up; the caller frees its->first), 1 (no rows: nothing to do), or the error to return
 * (−1 out of memory, −2 bad shapes, −3 an index out of range). */
static int prepare(const kv_index_t *ix, int64_t rows, int64_t heads, int64_t kv_heads,
                   int64_t hd, items_t *its) {
    its->first = NULL;
    if (bad_shape(rows, heads, kv_heads, hd, ix)) return -2;
    int64_t max_n;
    if (check_rows(ix, rows, &max_n)) return -3;
    if (rows == 0) return 1;
    return make_items(ix->row_seq, rows, max_n, its);
}

/* ragged_attention's work, called by every thread of an enclosing parallel region: each
 * thread takes items (the longest first) from one orphaned `omp for` with scratch of its own.
 * Returns 0, or 1 if this thread's scratch could not be allocated. */
static int attend_team(const float *q, int64_t heads, int64_t kv_heads, int64_t hd,
                       const void *k_pool, const void *v_pool, const kv_index_t *ix, float scale,
                       float *out, const items_t *its) {
    const int G = (int)(heads / kv_heads);
    const int64_t max_np = its->max_np, items = its->groups * kv_heads;
    const int kv_kind = (int)ix->kv_kind;
    /* position offsets, scaled queries, scores, maxima, sums */
    int64_t *off = malloc((size_t)max_np * sizeof(int64_t) + 8);
    float *qs = aligned_alloc(64, ((size_t)(ROWS * G * hd) * sizeof(float) + 63) / 64 * 64);
    float *s = aligned_alloc(64, ((size_t)(ROWS * G * max_np) * sizeof(float) + 63) / 64 * 64 + 64);
    __m256 *vmax = aligned_alloc(64, (size_t)(ROWS * G) * sizeof(__m256));
    float *inv = malloc((size_t)(ROWS * G) * sizeof(float));
    float *kt = aligned_alloc(64, ((size_t)(TILE * hd) * sizeof(float) + 63) / 64 * 64);
    const int ok = off && qs && s && vmax && inv && kt;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        if (!ok) continue;
        const int64_t grp = its->groups - 1 - it / kv_heads, h = it % kv_heads;
        const int64_t r0 = its->first[grp];
        const int m = (int)(its->first[grp + 1] - r0);
        int64_t n[ROWS], nmax = 0;
        float *o[ROWS];
        for (int i = 0; i < m; i++) {
            n[i] = (int64_t)ix->row_pos[r0 + i] + 1;
            nmax = n[i] > nmax ? n[i] : nmax;
            o[i] = out + ((r0 + i) * heads + h * G) * hd;
            const float *qg = q + ((r0 + i) * heads + h * G) * hd;  /* [G, hd] */
            for (int64_t j = 0; j < G * hd; j++) qs[i * G * hd + j] = qg[j] * scale;
        }
        const int64_t np = (nmax + TILE - 1) / TILE * TILE;
        const int32_t *table = ix->block_tables + (int64_t)ix->row_seq[r0] * ix->max_blocks;
        const int64_t bsz = ix->block_size;
        for (int64_t p = 0, b = 0; p < nmax; b++) {
            const int64_t base = ((int64_t)table[b] * kv_heads + h) * bsz * hd;
            for (int64_t o = 0; o < bsz && p < nmax; o++, p++) off[p] = base + o * hd;
        }
        /* one inlined copy per element kind: a constant kind in each */
        if (kv_kind == KV_F32) {
            scores(m, G, hd, n, nmax, np, qs, k_pool, KV_F32, off, s, vmax, kt);
            softmax(m, G, n, np, s, vmax, inv);
            values(m, G, hd, n, nmax, np, s, inv, v_pool, KV_F32, off, o);
        } else if (kv_kind == KV_F16) {
            scores(m, G, hd, n, nmax, np, qs, k_pool, KV_F16, off, s, vmax, kt);
            softmax(m, G, n, np, s, vmax, inv);
            values(m, G, hd, n, nmax, np, s, inv, v_pool, KV_F16, off, o);
        } else {
            scores(m, G, hd, n, nmax, np, qs, k_pool, KV_BF16, off, s, vmax, kt);
            softmax(m, G, n, np, s, vmax, inv);
            values(m, G, hd, n, nmax, np, s, inv, v_pool, KV_BF16, off, o);
        }
    }
    free(off), free(qs), free(s), free(vmax), free(inv), free(kt);
    return !ok;
}

/* out [rows, heads, hd] = causal attention of q [rows, heads, hd] on each row's sequence in
 * k_pool/v_pool [num_blocks, kv_heads, block_size, hd] (elements of kind kv_kind) through
 * block_tables [num_seqs, max_blocks] (int32), row_seq [rows] and row_pos [rows] (int32). hd a
 * multiple of 8. Returns 0, −1 when out of memory, −2 on bad sizes or kind, −3 on a sequence,
 * position or block id out of range (checked before anything is computed).
 *
 * How rows fall into work items (`make_items`) changes only which loads are shared, never a
 * row's arithmetic. */
int ragged_attention(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                     const void *k_pool, const void *v_pool, int64_t kv_kind, int64_t num_blocks,
                     int64_t block_size, const int32_t *block_tables, int64_t num_seqs,
                     int64_t max_blocks, const int32_t *row_seq, const int32_t *row_pos,
                     float scale, float *out) {
    const kv_index_t ix = {kv_kind, num_blocks, block_size, block_tables, num_seqs, max_blocks,
                           row_seq, row_pos};
    items_t its;
    const int ready = prepare(&ix, rows, heads, kv_heads, hd, &its);
    if (ready) return ready > 0 ? 0 : ready;
    int failed = 0;
#pragma omp parallel
    {
        if (attend_team(q, heads, kv_heads, hd, k_pool, v_pool, &ix, scale, out, &its)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(its.first);
    return failed ? -1 : 0;
}

/* ---- the rest of a decoder layer's per-row work (models/transformer.py's native path) ----
 * Each row is computed on its own in a fixed order, so these keep batch invariance too. The
 * `_team` functions are called by every thread of an enclosing parallel region and share
 * their rows out in one orphaned `omp for` (ending at a barrier). */

/* o [dim] = w ⊙ (x · 1/√(mean(x²) + eps)) (RMSNorm): the squares summed in 8 lanes by FMA,
 * one fixed horizontal sum. o may be x. */
static inline void rms_row(const float *xr, int64_t dim, const float *w, float eps, float *o) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (; i < dim; i++) sum += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(xr + i), vi)));
    for (; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
}

/* out [rows, dim] = RMSNorm of x [rows, dim] with weight w; out may be x. */
int rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float *out) {
    if (rows < 0 || dim <= 0) return -2;
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * dim, dim, w, eps, out + r * dim);
    return 0;
}

/* x [rows, dim] += add (when not NULL), then out = RMSNorm of x with weight w. */
static void add_norm_team(float *x, const float *add, int64_t rows, int64_t dim, const float *w,
                          float eps, float *out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (add)
            for (int64_t i = 0; i < dim; i++) xr[i] += add[r * dim + i];
        rms_row(xr, dim, w, eps, out + r * dim);
    }
}

/* Rotary embedding of one head vector (rotate-half layout), as PyTorch's
 * x·cos + rotate_half(x)·sin computes it: each product rounded, then the sum. */
static inline void rope_head(const float *x, const float *cos, const float *sin, int64_t hd,
                             float *out) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i] * cos[i], b = -x[i + half] * sin[i];
        const float c = x[i + half] * cos[i + half], d = x[i] * sin[i + half];
        out[i] = a + b;
        out[i + half] = c + d;
    }
}

/* The rotary embedding of q and k of qkv [rows, (heads + 2·kv_heads)·hd] with cos/sin
 * [rows, hd]: the queries into q [rows, heads, hd], k and v stored at each row's position
 * (krot [rows, hd]: room for a rotated key on its way into a narrow pool). */
static void rope_store_team(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                            int64_t hd, const float *cos, const float *sin, void *k_pool,
                            void *v_pool, const kv_index_t *ix, float *q, float *krot) {
    const int64_t width = (heads + 2 * kv_heads) * hd, bsz = ix->block_size;
    const int kind = (int)ix->kv_kind;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = qkv + r * width, *c = cos + r * hd, *sn = sin + r * hd;
        for (int64_t h = 0; h < heads; h++) rope_head(src + h * hd, c, sn, hd, q + (r * heads + h) * hd);
        const int64_t pos = ix->row_pos[r];
        const int64_t id = ix->block_tables[(int64_t)ix->row_seq[r] * ix->max_blocks + pos / bsz];
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = ((id * kv_heads + h) * bsz + pos % bsz) * hd;
            const float *v = src + (heads + kv_heads + h) * hd;
            if (kind == KV_F32) {  /* rotate straight into the pool */
                rope_head(src + (heads + h) * hd, c, sn, hd, (float *)k_pool + at);
                memcpy((float *)v_pool + at, v, (size_t)hd * sizeof(float));
            } else {
                rope_head(src + (heads + h) * hd, c, sn, hd, krot + r * hd);
                kv_store(k_pool, at, krot + r * hd, hd, kind);
                kv_store(v_pool, at, v, hd, kind);
            }
        }
    }
}

/* Room for rope_store_team's rotated queries [rows, heads, hd] and keys [rows, hd]. */
static float *rope_buffer(int64_t rows, int64_t heads, int64_t hd) {
    return aligned_alloc(64, ((size_t)((rows * heads + rows) * hd) * sizeof(float) + 63) / 64 * 64
                                 + 64);
}

/* One attention block of a pass: qkv [rows, (heads + 2·kv_heads)·hd] (per row: q heads, then
 * k heads, then v heads) → rotary embedding of q and k with cos/sin [rows, hd], k and v stored
 * at each row's position in k_pool/v_pool (as `ragged_attention` addresses them; rounded to
 * nearest even into a float16 or bfloat16 pool), then `ragged_attention` of the rotated
 * queries into out [rows, heads, hd]. Returns what ragged_attention returns; on −2/−3
 * (checked first) nothing is written. */
int rope_store_attend(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                      int64_t hd, const float *cos, const float *sin, void *k_pool,
                      void *v_pool, int64_t kv_kind, int64_t num_blocks, int64_t block_size,
                      const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                      const int32_t *row_seq, const int32_t *row_pos, float scale, float *out) {
    const kv_index_t ix = {kv_kind, num_blocks, block_size, block_tables, num_seqs, max_blocks,
                           row_seq, row_pos};
    items_t its;
    const int ready = prepare(&ix, rows, heads, kv_heads, hd, &its);
    if (ready) return ready > 0 ? 0 : ready;
    float *q = rope_buffer(rows, heads, hd);
    if (!q) {
        free(its.first);
        return -1;
    }
    int failed = 0;
#pragma omp parallel
    {
        rope_store_team(qkv, rows, heads, kv_heads, hd, cos, sin, k_pool, v_pool, &ix, q,
                        q + rows * heads * hd);
        if (attend_team(q, heads, kv_heads, hd, k_pool, v_pool, &ix, scale, out, &its)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(q), free(its.first);
    return failed ? -1 : 0;
}

/* out [rows, inter] = silu(g)·u for gu [rows, 2·inter] (per row: g, then u), silu(x) =
 * x / (1 + e^−x) through t = e^−|x| (exp_nonpos): x / (1 + t) for x ≥ 0, x·t / (1 + t) below.
 * Elementwise: how the work is split never changes a bit. */
#define SILU_CHUNK 2048 /* elements of a row per work item (a multiple of 8) */
static void silu_item(const float *gu, int64_t inter, int64_t chunks, int64_t item, float *out) {
    const int64_t r = item / chunks, lo = item % chunks * SILU_CHUNK;
    const int64_t hi = lo + SILU_CHUNK < inter ? lo + SILU_CHUNK : inter;
    const float *g = gu + r * 2 * inter, *u = g + inter;
    float *o = out + r * inter;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 t = exp_nonpos(_mm256_or_ps(x, sign));  /* e^−|x| */
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, t), neg);
        const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, t));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < hi; i++) {
        const float x = g[i], t = expf(-fabsf(x));
        o[i] = (x < 0.0f ? x * t : x) / (1.0f + t) * u[i];
    }
}

int silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
    if (rows < 0 || inter <= 0) return -2;
    const int64_t chunks = (inter + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for schedule(static) if (rows * inter >= 4 * SILU_CHUNK)
    for (int64_t item = 0; item < rows * chunks; item++) silu_item(gu, inter, chunks, item, out);
    return 0;
}

/* ---- a whole decoder pass in one call ----
 * `decoder_pass` runs every layer of a pass (RMSNorm → q/k/v → [per-head q/k norms] →
 * rotary embedding, cache write, attention → o → residual → RMSNorm → gate/up → SiLU·up →
 * down → residual) and the final norm inside one parallel region: no return to Python and no
 * new thread team between the steps, only the barriers that end each shared loop. Each step
 * is the function the per-call path runs (`rms_norm`, `rope_store_attend`, `silu_mul` here,
 * the matmul library's projections through `proj`), so every row gets the same bits as there.
 * The projections live in the matmul library (qmatmul.c): `proj` is its `proj_team` and each
 * layer's projections are its `proj_t`s, opaque here. */

typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *mlp_norm;  /* [hidden], [hd] | NULL ×2, [hidden] */
    const void *qkv, *o, *gate_up, *down;  /* the matmul library's proj_t */
} layer_t;

typedef struct {  /* a model's shapes and constants */
    int64_t hidden, heads, kv_heads, hd, inter;
    float eps, scale;
} dims_t;

typedef struct {  /* a pass's float32 work buffers */
    float *h;     /* [rows, hidden] */
    float *qkv;   /* [rows, (heads + 2·kv_heads)·hd] */
    float *attn;  /* [rows, heads·hd] */
    float *gu;    /* [rows, 2·inter] */
    float *act;   /* [rows, inter] */
    float *proj;  /* [rows, hidden] */
} buffers_t;

typedef int (*proj_fn)(const void *p, const float *x, int64_t rows, float *y);

/* Per-head RMSNorm (qwen3, gemma3) of the query and key heads of qkv, in place. */
static void head_norms_team(float *qkv, int64_t rows, const dims_t *d, const float *q_norm,
                            const float *k_norm) {
    const int64_t hd = d->hd, width = (d->heads + 2 * d->kv_heads) * hd;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * width;
        for (int64_t h = 0; h < d->heads; h++) rms_row(row + h * hd, hd, q_norm, d->eps, row + h * hd);
        for (int64_t h = d->heads; h < d->heads + d->kv_heads; h++)
            rms_row(row + h * hd, hd, k_norm, d->eps, row + h * hd);
    }
}

/* The steps of a pass, as `decoder_pass` profiles them. */
enum { ST_NORM, ST_QKV, ST_ROPE, ST_ATTEND, ST_O, ST_GATE_UP, ST_SILU, ST_DOWN, NUM_STEPS };

/* x [rows, hidden] (the embeddings; left as the last residual stream) → out [rows, hidden]:
 * the final norm's output, through `num_layers` layers whose keys and values go to the pools
 * at keys/values + layer · layer_bytes. `profile` [NUM_STEPS] or NULL: seconds spent in each
 * kind of step, added (as the first thread sees them, each step ending at its barrier; the
 * per-head norms count with ST_ROPE, the residual adds with ST_NORM). Returns 0, −1 when out
 * of memory, −2 on bad shapes, −3 on an index out of range (checked before anything is
 * written). */
int decoder_pass(proj_fn proj, const layer_t *layers, int64_t num_layers, const dims_t *d,
                 float *x, int64_t rows, const float *cos, const float *sin, void *keys,
                 void *values, int64_t layer_bytes, const kv_index_t *ix, const buffers_t *buf,
                 const float *final_norm, float *out, double *profile) {
    if (d->hidden <= 0 || d->inter <= 0 || num_layers < 0 || layer_bytes < 0) return -2;
    items_t its;
    const int ready = prepare(ix, rows, d->heads, d->kv_heads, d->hd, &its);
    if (ready) return ready > 0 ? 0 : ready;
    float *q = rope_buffer(rows, d->heads, d->hd);
    if (!q) {
        free(its.first);
        return -1;
    }
    const int64_t chunks = (d->inter + SILU_CHUNK - 1) / SILU_CHUNK;
    int failed = 0;
#pragma omp parallel
    {
        int f = 0;
        const int timing = profile && omp_get_thread_num() == 0;
        double t = timing ? omp_get_wtime() : 0.0;
#define STEP_DONE(step)                            \
        if (timing) {                              \
            const double now = omp_get_wtime();    \
            profile[step] += now - t;              \
            t = now;                               \
        }
        for (int64_t l = 0; l < num_layers; l++) {
            const layer_t *L = layers + l;
            char *kp = (char *)keys + l * layer_bytes, *vp = (char *)values + l * layer_bytes;
            add_norm_team(x, l ? buf->proj : NULL, rows, d->hidden, L->attn_norm, d->eps, buf->h);
            STEP_DONE(ST_NORM)
            f |= proj(L->qkv, buf->h, rows, buf->qkv);
            STEP_DONE(ST_QKV)
            if (L->q_norm) head_norms_team(buf->qkv, rows, d, L->q_norm, L->k_norm);
            rope_store_team(buf->qkv, rows, d->heads, d->kv_heads, d->hd, cos, sin, kp, vp, ix, q,
                            q + rows * d->heads * d->hd);
            STEP_DONE(ST_ROPE)
            f |= attend_team(q, d->heads, d->kv_heads, d->hd, kp, vp, ix, d->scale, buf->attn,
                             &its);
            STEP_DONE(ST_ATTEND)
            f |= proj(L->o, buf->attn, rows, buf->proj);
            STEP_DONE(ST_O)
            add_norm_team(x, buf->proj, rows, d->hidden, L->mlp_norm, d->eps, buf->h);
            STEP_DONE(ST_NORM)
            f |= proj(L->gate_up, buf->h, rows, buf->gu);
            STEP_DONE(ST_GATE_UP)
#pragma omp for schedule(static)
            for (int64_t item = 0; item < rows * chunks; item++)
                silu_item(buf->gu, d->inter, chunks, item, buf->act);
            STEP_DONE(ST_SILU)
            f |= proj(L->down, buf->act, rows, buf->proj);
            STEP_DONE(ST_DOWN)
        }
        add_norm_team(x, num_layers ? buf->proj : NULL, rows, d->hidden, final_norm, d->eps, out);
        STEP_DONE(ST_NORM)
#undef STEP_DONE
        if (f) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(q), free(its.first);
    return failed ? -1 : 0;
}
