/* Paged decode attention on the CPU, reading K/V where they lie in the block cache.
 *
 * One query token per decoding request attends over that request's cached keys, block by block
 * through its block table, with an online softmax: no gather, no padding, no mask. Work items are
 * (request, part of its context), spread over OpenMP threads (the runtime torch
 * loaded, found by its soname): each request's context in `splits` parts (more than one when the
 * batch has too few requests to keep every thread busy), merged by their log-sum-exps at the end.
 *
 * Layouts (row-major): q, out [T, H, Dh]; k_cache, v_cache [N, S, Hkv, Dh]; all float32
 * (`mmserve_paged_decode_f32`), bfloat16 (`_bf16`) or float16 (`_f16`; finite values), or q and
 * out float32 over a bfloat16 or float16 cache (`_f32_bf16kv`, `_f32_f16kv`): each 16-bit element
 * widened to float32 as it is read (float16 by F16C's conversions where the machine has them,
 * else by integer and float operations), the sums float32, a 16-bit output rounded to the nearest
 * 16-bit value; tables [B, W] int64 (block ids, W the widest table); seq_lens [B] int64 (keys per request,
 * this step's included); rows [B] int64 (each request's row of q and out). Query head i reads
 * key/value head i / (H / Hkv), as torch's enable_gqa does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 1024
#define MAX_BLOCK 1024
/* below any score: no infinities, so the file builds with -ffast-math (vectorised expf) */
#define NO_SCORE -1e30f

/* the `lines` cache lines of key t's rows (all KV heads) in the block at `next` */
static inline void fetch_key(const void *next, int64_t t, int64_t lines) {
    for (int64_t c = 0; c < lines; c++) __builtin_prefetch((const char *)next + (t * lines + c) * 64);
}

/* float32 as it lies, bfloat16 widened by a shift, float16 by a rebias (below) */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float16's magnitude bits moved into float32's place, scaled by 2^(127 - 15) to rebias the
 * exponent (subnormals included), and its sign: integer and float operations that vectorise */
static inline float f16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    f *= 0x1p112f;
    memcpy(&bits, &f, sizeof f);
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* q . k and a += w * v over n elements, k and v of each type (WIDEN_LOOPS: plain loops the
 * compiler vectorises); float16 by the F16C conversions where the machine has them */
#define WIDEN_LOOPS(DOT, AXPY, ELEM, WIDEN)                                                          \
    static inline float DOT(const float *q, const ELEM *k, int64_t n) {                             \
        float dot = 0.0f;                                                                           \
        _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < n; d++) dot += q[d] * WIDEN(k[d]); \
        return dot;                                                                                 \
    }                                                                                               \
    static inline void AXPY(float *a, float w, const ELEM *v, int64_t n) {                          \
        _Pragma("omp simd") for (int64_t d = 0; d < n; d++) a[d] += w * WIDEN(v[d]);                \
    }

WIDEN_LOOPS(dot_f32, axpy_f32, float, )
WIDEN_LOOPS(dot_bf16, axpy_bf16, uint16_t, bf16_to_f32)
#if defined(__AVX512F__) || (defined(__F16C__) && defined(__FMA__))
#if defined(__AVX512F__)
#define HW 16
typedef __m512 hvec;
#define H_LOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F_LOAD _mm512_loadu_ps
#define F_STORE _mm512_storeu_ps
#define H_FMA _mm512_fmadd_ps
#define H_SET1 _mm512_set1_ps
#define H_ZERO _mm512_setzero_ps
#define H_SUM(v) _mm512_reduce_add_ps(v)
#else
#define HW 8
typedef __m256 hvec;
#define H_LOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F_LOAD _mm256_loadu_ps
#define F_STORE _mm256_storeu_ps
#define H_FMA _mm256_fmadd_ps
#define H_SET1 _mm256_set1_ps
#define H_ZERO _mm256_setzero_ps
static inline float H_SUM(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif
static inline float dot_f16(const float *q, const uint16_t *k, int64_t n) {
    hvec a = H_ZERO(), b = H_ZERO();  /* two chains */
    int64_t d = 0;
    for (; d + 2 * HW <= n; d += 2 * HW) {
        a = H_FMA(F_LOAD(q + d), H_LOAD(k + d), a);
        b = H_FMA(F_LOAD(q + d + HW), H_LOAD(k + d + HW), b);
    }
    float dot = H_SUM(a) + H_SUM(b);
    for (; d < n; d++) dot += q[d] * f16_to_f32(k[d]);
    return dot;
}

static inline void axpy_f16(float *a, float w, const uint16_t *v, int64_t n) {
    const hvec wv = H_SET1(w);
    int64_t d = 0;
    for (; d + HW <= n; d += HW) F_STORE(a + d, H_FMA(wv, H_LOAD(v + d), F_LOAD(a + d)));
    for (; d < n; d++) a[d] += w * f16_to_f32(v[d]);
}
#else
WIDEN_LOOPS(dot_f16, axpy_f16, uint16_t, f16_to_f32)
#endif

/* scores[i * S + t] = scale * q_i . k_t for every query head i and the n keys of one block (kb:
 * its first key's rows), while the next block's K (k_next) is fetched a key's rows at a time: it
 * lies anywhere in the cache, out of the hardware prefetcher's sight */
#define BLOCK_SCORES(NAME, ELEM, DOT)                                                                  \
    static void NAME(const float *q, const void *k_block, const void *k_next, int64_t n, int64_t H,    \
                     int64_t group, int64_t Dh, int64_t S, float scale, float *scores) {               \
        const ELEM *kb = k_block;                                                                       \
        const int64_t token_stride = H / group * Dh, lines = (token_stride * (int64_t)sizeof(ELEM) + 63) / 64; \
        for (int64_t t = 0; t < n; t++) {                                                               \
            fetch_key(k_next, t, lines);                                                                \
            for (int64_t i = 0; i < H; i++)                                                             \
                scores[i * S + t] = DOT(q + i * Dh, kb + t * token_stride + i / group * Dh, Dh) * scale; \
        }                                                                                               \
    }

/* acc[i] += p[i * S + t] * v_t for every query head i and the n values of one block, while the next
 * block's V (v_next) is fetched a key's rows at a time */
#define BLOCK_VALUES(NAME, ELEM, AXPY)                                                                 \
    static void NAME(float *acc, const void *v_block, const void *v_next, int64_t n, int64_t H,        \
                     int64_t group, int64_t Dh, int64_t S, const float *p) {                           \
        const ELEM *vb = v_block;                                                                       \
        const int64_t token_stride = H / group * Dh, lines = (token_stride * (int64_t)sizeof(ELEM) + 63) / 64; \
        for (int64_t t = 0; t < n; t++) {                                                               \
            fetch_key(v_next, t, lines);                                                                \
            for (int64_t i = 0; i < H; i++)                                                             \
                AXPY(acc + i * Dh, p[i * S + t], vb + t * token_stride + i / group * Dh, Dh);           \
        }                                                                                               \
    }

BLOCK_SCORES(scores_f32, float, dot_f32)
BLOCK_VALUES(values_f32, float, axpy_f32)
BLOCK_SCORES(scores_bf16, uint16_t, dot_bf16)
BLOCK_VALUES(values_bf16, uint16_t, axpy_bf16)
BLOCK_SCORES(scores_f16, uint16_t, dot_f16)
BLOCK_VALUES(values_f16, uint16_t, axpy_f16)

/* float32 q over a 16-bit cache: by query head pair where the machine has the vector widening */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include "grouped_16bit.h"
#else
#define scores_gf16 scores_f16
#define values_gf16 values_f16
#define scores_gbf16 scores_bf16
#define values_gbf16 values_bf16
#endif

/* to[x] = from[x] (n of them) widened to float32 */
static void widen_bf16(float *to, const void *from, int64_t n) {
    const uint16_t *h = from;
#pragma omp simd
    for (int64_t x = 0; x < n; x++) to[x] = bf16_to_f32(h[x]);
}

static void widen_f16(float *to, const void *from, int64_t n) {
    const uint16_t *h = from;
#pragma omp simd
    for (int64_t x = 0; x < n; x++) to[x] = f16_to_f32(h[x]);
}

/* to[x] = from[x] (finite, n of them) rounded to the nearest 16-bit value, ties to even */
static void narrow_bf16(void *to, const float *from, int64_t n) {
    uint16_t *h = to;
    for (int64_t x = 0; x < n; x++) {
        uint32_t bits;
        memcpy(&bits, from + x, sizeof bits);
        h[x] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
}

static void narrow_f16(void *to, const float *from, int64_t n) {
    uint16_t *h = to;
    for (int64_t x = 0; x < n; x++) {
        const float a = fabsf(from[x]);
        uint32_t bits, sign;
        memcpy(&bits, from + x, sizeof bits);
        sign = bits >> 16 & 0x8000;
        memcpy(&bits, &a, sizeof bits);
        if (a >= 65520.0f) /* past the largest finite value's rounding range */
            h[x] = (uint16_t)(sign | 0x7c00);
        else if (a < 0x1p-14f) /* subnormal: in units of the smallest one */
            h[x] = (uint16_t)(sign | (uint32_t)lrintf(a * 0x1p24f));
        else /* rounded at float16's last mantissa bit, the exponent rebiased */
            h[x] = (uint16_t)(sign | (((bits + 0xfff + (bits >> 13 & 1)) >> 13) - ((127 - 15) << 10)));
    }
}

/* How the element types are read and written: the cache's blocks (scores, values, size), q's
 * rows and out's (widen, narrow: both NULL for float32, else of 16-bit elements) */
typedef struct {
    void (*scores)(const float *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                   float, float *);
    void (*values)(float *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                   const float *);
    void (*widen)(float *, const void *, int64_t);   /* NULL: float32 */
    void (*narrow)(void *, const float *, int64_t);  /* NULL: float32 */
    int64_t size;                                    /* bytes of a cache element */
} Elem;

/* One part of one request's context, every head: blocks [first, last) of its table, each block
 * read in memory order (token by token, each token's heads side by side). acc[i][d] (query head
 * i) is left unnormalised, with the running max m[i] and sum l[i] of exp(score - m). */
static void attend_part(const Elem *e, const float *q, const char *k_cache, const char *v_cache,
                        const int64_t *table, int64_t seq_len, int64_t first, int64_t last,
                        int64_t H, int64_t Hkv, int64_t Dh, int64_t S, float scale,
                        float *acc, float *m, float *l, float *scores /* [H, S] */) {
    const int64_t group = H / Hkv, block_bytes = S * Hkv * Dh * e->size;
    for (int64_t i = 0; i < H; i++) {
        m[i] = NO_SCORE;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * H * Dh);
    for (int64_t j = first; j < last; j++) {
        const int64_t n = seq_len - j * S < S ? seq_len - j * S : S;
        const int64_t block = table[j] * block_bytes, next = table[j + 1 < last ? j + 1 : j] * block_bytes;
        e->scores(q, k_cache + block, k_cache + next, n, H, group, Dh, S, scale, scores);
        for (int64_t i = 0; i < H; i++) {
            float *si = scores + i * S, block_max = NO_SCORE;
            for (int64_t t = 0; t < n; t++) block_max = si[t] > block_max ? si[t] : block_max;
            const float m_new = block_max > m[i] ? block_max : m[i];
            const float rescale = expf(m[i] - m_new);  /* 0 on the first block */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                si[t] = expf(si[t] - m_new);
                sum += si[t];
            }
            l[i] = l[i] * rescale + sum;
            m[i] = m_new;
            if (rescale != 1.0f) {
                float *ai = acc + i * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) ai[d] *= rescale;
            }
        }
        e->values(acc, v_cache + block, v_cache + next, n, H, group, Dh, S, scores);
    }
}

/* Returns 0, or -1 when a shape is beyond the kernel's limits (the caller then uses another path). */
static int paged_decode(const Elem *e, const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *tables, const int64_t *seq_lens, const int64_t *rows, void *out, int64_t B,
                        int64_t W, int64_t H, int64_t Hkv, int64_t Dh, int64_t S, float scale, int64_t splits,
                        int threads) {
    if (Dh > MAX_HEAD_DIM || S > MAX_BLOCK || splits < 1 || H % Hkv) return -1;
    const int64_t items = B * splits;
    /* per item: acc [H, Dh], m [H], l [H], scores [H, S], q's row widened [H, Dh] */
    const int64_t per_item = H * (Dh + 2 + S + Dh);
    float *work = malloc(sizeof(float) * items * per_item);
    if (!work) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / splits, part = item % splits;
        const int64_t blocks = (seq_lens[b] + S - 1) / S;
        const int64_t per_part = (blocks + splits - 1) / splits;
        const int64_t first = part * per_part < blocks ? part * per_part : blocks;
        const int64_t last = first + per_part < blocks ? first + per_part : blocks;
        float *acc = work + item * per_item, *m = acc + H * Dh, *l = m + H, *qf = l + H + H * S;
        if (e->widen)
            e->widen(qf, (const uint16_t *)q + rows[b] * H * Dh, H * Dh);
        else
            qf = (float *)q + rows[b] * H * Dh;
        attend_part(e, qf, k_cache, v_cache, tables + b * W, seq_lens[b], first, last, H, Hkv, Dh, S, scale, acc,
                    m, l, l + H);
    }
    /* merge each request's parts and normalise */
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < H; i++) {
            float m_all = NO_SCORE;
            for (int64_t p = 0; p < splits; p++) {
                const float mp = work[(b * splits + p) * per_item + H * Dh + i];
                m_all = mp > m_all ? mp : m_all;
            }
            float o16[MAX_HEAD_DIM], *o = e->narrow ? o16 : (float *)out + (rows[b] * H + i) * Dh;
            float total = 0.0f;
            memset(o, 0, sizeof(float) * Dh);
            for (int64_t p = 0; p < splits; p++) {
                const float *acc = work + (b * splits + p) * per_item;
                const float mp = acc[H * Dh + i], lp = acc[H * Dh + H + i];
                if (lp == 0.0f) continue;  /* an empty part */
                const float w = expf(mp - m_all);
                total += lp * w;
                const float *ai = acc + i * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) o[d] += w * ai[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) o[d] *= inv;
            if (e->narrow) e->narrow((uint16_t *)out + (rows[b] * H + i) * Dh, o, Dh);
        }
    }
    free(work);
    return 0;
}

/* The entry points, one per (q's and out's element type, the cache's) (the same arguments) */
#define ENTRY(NAME, ELEM)                                                                              \
    int NAME(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,           \
             const int64_t *seq_lens, const int64_t *rows, void *out, int64_t B, int64_t W, int64_t H,  \
             int64_t Hkv, int64_t Dh, int64_t S, float scale, int64_t splits, int threads) {          \
        return paged_decode(&ELEM, q, k_cache, v_cache, tables, seq_lens, rows, out, B, W, H, Hkv, Dh, \
                            S, scale, splits, threads);                                                \
    }

static const Elem F32 = {scores_f32, values_f32, NULL, NULL, sizeof(float)};
static const Elem BF16 = {scores_bf16, values_bf16, widen_bf16, narrow_bf16, sizeof(uint16_t)};
static const Elem F16 = {scores_f16, values_f16, widen_f16, narrow_f16, sizeof(uint16_t)};
ENTRY(mmserve_paged_decode_f32, F32)
ENTRY(mmserve_paged_decode_bf16, BF16)
ENTRY(mmserve_paged_decode_f16, F16)
static const Elem F32_BF16KV = {scores_gbf16, values_gbf16, NULL, NULL, sizeof(uint16_t)};
static const Elem F32_F16KV = {scores_gf16, values_gf16, NULL, NULL, sizeof(uint16_t)};
ENTRY(mmserve_paged_decode_f32_bf16kv, F32_BF16KV)
ENTRY(mmserve_paged_decode_f32_f16kv, F32_F16KV)
