/* Scores and values of float32 queries over a 16-bit KV cache (`--kv-cache-dtype`), by query
 * head group: each key's and value's row is loaded and widened once for two query heads that
 * share its KV head. Scores in tiles of HW (head, key) pairs, one accumulator each, whose HW sums
 * one shuffle-and-add tree reduces; a head's value sums stay in registers over a block's tokens
 * (AVX-512: a row of 128 a pass), stored once a block; the next block fetched a few lines at a
 * time between them (bursts stall on full miss buffers). Included by paged_decode.c after its
 * vector macros (HW lanes of hvec: H_LOAD, F_LOAD, F_STORE, H_FMA, H_SET1, H_ZERO, H_SUM) and its
 * widening functions; the same arguments as its BLOCK_SCORES / BLOCK_VALUES functions. Sums in
 * float32, in another order than the float32 kernel's. */

#if defined(__AVX512F__)
#define BF_LOAD(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define BF_LOAD(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

/* s[x * S] = scale * q_x . k for the R (1 or 2) query heads x of q (rows of Dh) over one key's row k */
#define HEADS_DOT(NAME, R, LOAD, WIDEN)                                                                \
    static inline void NAME(const float *q, const uint16_t *k, int64_t Dh, int64_t S, float scale, float *s) { \
        hvec acc[R];                                                                                   \
        for (int r = 0; r < R; r++) acc[r] = H_ZERO();                                                 \
        int64_t d = 0;                                                                                 \
        for (; d + HW <= Dh; d += HW) {                                                                \
            const hvec kv = LOAD(k + d);                                                               \
            for (int r = 0; r < R; r++) acc[r] = H_FMA(F_LOAD(q + r * Dh + d), kv, acc[r]);            \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            float dot = H_SUM(acc[r]);                                                                 \
            for (int64_t e = d; e < Dh; e++) dot += q[r * Dh + e] * WIDEN(k[e]);                       \
            s[r * S] = dot * scale;                                                                    \
        }                                                                                              \
    }

/* One hvec whose lane 4k + m holds the sum of u[m * HW / 4 + k]'s lanes (k < HW / 4, m < 4): HW
 * vectors' sums by a tree of shuffles and adds (HW - 1 adds in all, not HW horizontal sums) */
#if defined(__AVX512F__)
static inline __m512 sum_lanes(const __m512 *u) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* chunks 0-1: u[2i]'s halves added, 2-3: u[2i + 1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xee));
    for (int j = 0; j < 4; j++) /* chunk k: u[4j + k]'s quarters added */
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* chunk k: two lanes of u[8i + k], two of u[8i + 4 + k] */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}
#else
static inline __m256 sum_lanes(const __m256 *u) {
    __m256 w[4], x[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: u[2i]'s halves added, 4-7: u[2i + 1]'s */
        w[i] = _mm256_add_ps(_mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* chunk k: two lanes of u[4i + k], two of u[4i + 2 + k] */
        x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xdd));
}
#endif

/* s[x * S + t] = scale * q_x . k_t for the R (1 or 2) query heads x of q and HW / R keys t (rows
 * `stride` apart from k): HW accumulators, one per (head, key), summed together by sum_lanes.
 * Dh a multiple of HW. */
#define TILE_DOT(NAME, R, LOAD)                                                                        \
    static inline void NAME(const float *q, const uint16_t *k, int64_t stride, int64_t Dh, int64_t S,  \
                            float scale, float *s, Fetch *f) {                                         \
        enum { T = HW / R };                                                                           \
        hvec acc[HW];                                                                                  \
        float sums[HW];                                                                                \
        for (int u = 0; u < HW; u++) acc[u] = H_ZERO();                                                \
        for (int64_t d = 0; d < Dh; d += HW) {                                                         \
            hvec qv[R];                                                                                \
            fetch_some(f, f->share);                                                                   \
            for (int r = 0; r < R; r++) qv[r] = F_LOAD(q + r * Dh + d);                                \
            for (int t = 0; t < T; t++) {                                                              \
                const hvec kv = LOAD(k + t * stride + d);                                              \
                for (int r = 0; r < R; r++) acc[r * T + t] = H_FMA(qv[r], kv, acc[r * T + t]);         \
            }                                                                                          \
        }                                                                                              \
        F_STORE(sums, sum_lanes(acc));                                                                 \
        for (int L = 0; L < HW; L++) {                                                                 \
            const int u = L % 4 * (HW / 4) + L / 4;                                                    \
            s[u / T * S + u % T] = sums[L] * scale;                                                    \
        }                                                                                              \
    }

/* the next block's `total` cache lines from `next`, fetched `share` at a time (`at`: those issued) */
typedef struct {
    const char *next;
    int64_t at, share, total;
} Fetch;

static inline Fetch fetch_plan(const void *next, int64_t bytes, int64_t steps) {
    const int64_t total = (bytes + 63) / 64;
    return (Fetch){next, 0, (total + steps - 1) / steps + 1, total};
}

static inline void fetch_some(Fetch *f, int64_t lines) {
    const int64_t to = f->at + lines < f->total ? f->at + lines : f->total;
    for (; f->at < to; f->at++) __builtin_prefetch(f->next + f->at * 64);
}

/* heads i (and i + 1 where they share a KV head: R = 2) over the block's n keys: tiles of HW / R
 * keys, then key by key; a share of the next block's lines fetched a tile's step */
#define HEAD_SCORES(NAME, ONE, TWO, TONE, TTWO)                                                        \
    static inline void NAME(const float *q, const uint16_t *k, int64_t n, int64_t R, int64_t stride,   \
                            int64_t Dh, int64_t S, float scale, float *s, Fetch *f) {                  \
        const int64_t T = HW / R;                                                                      \
        int64_t t = 0;                                                                                 \
        if (Dh % HW == 0)                                                                              \
            for (; t + T <= n; t += T) {                                                               \
                if (R == 2)                                                                            \
                    TTWO(q, k + t * stride, stride, Dh, S, scale, s + t, f);                           \
                else                                                                                   \
                    TONE(q, k + t * stride, stride, Dh, S, scale, s + t, f);                           \
            }                                                                                          \
        for (; t < n; t++) {                                                                           \
            if (R == 2)                                                                                \
                TWO(q, k + t * stride, Dh, S, scale, s + t);                                           \
            else                                                                                       \
                ONE(q, k + t * stride, Dh, S, scale, s + t);                                           \
        }                                                                                              \
    }

#define GROUP_SCORES(NAME, HEAD)                                                                       \
    static void NAME(const float *q, const void *k_block, const void *k_next, int64_t n, int64_t H,    \
                     int64_t group, int64_t Dh, int64_t S, float scale, float *scores) {               \
        const uint16_t *kb = k_block;                                                                  \
        const int64_t token_stride = H / group * Dh;                                                   \
        Fetch f = fetch_plan(k_next, n * token_stride * 2, (n * H + HW - 1) / HW * (Dh / HW + 1)); /* tiles' steps */ \
        for (int64_t i = 0; i < H;) {                                                                  \
            const int64_t R = (i + 1) % group ? 2 : 1; /* heads i and i + 1 share a KV head */         \
            HEAD(q + i * Dh, kb + i / group * Dh, n, R, token_stride, Dh, S, scale, scores + i * S,    \
                 &f);                                                                                  \
            i += R;                                                                                    \
        }                                                                                              \
        fetch_some(&f, f.total);                                                                       \
    }

/* a[x * Dh + d + e] += sum_t p[x * S + t] * v_t[d + e] (e < C * HW) for the R (1 or 2) query
 * heads x of acc rows a, over a block's n tokens of one KV head (vb: its row in the block's first
 * token; rows `stride` apart): C vectors of each row in registers, a share of the next block
 * fetched a key */
#define VALUES_PASS(NAME, R, C, LOAD)                                                                  \
    static inline void NAME(float *a, const uint16_t *vb, int64_t stride, int64_t n, int64_t d,        \
                            int64_t Dh, int64_t S, const float *p, Fetch *f) {                         \
        hvec acc[R][C];                                                                                \
        for (int r = 0; r < R; r++)                                                                    \
            for (int c = 0; c < C; c++) acc[r][c] = F_LOAD(a + r * Dh + d + c * HW);                   \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const uint16_t *v = vb + t * stride + d;                                                   \
            hvec x[C];                                                                                 \
            fetch_some(f, f->share);                                                                   \
            for (int c = 0; c < C; c++) x[c] = LOAD(v + c * HW);                                       \
            for (int r = 0; r < R; r++) {                                                              \
                const hvec w = H_SET1(p[r * S + t]);                                                   \
                for (int c = 0; c < C; c++) acc[r][c] = H_FMA(w, x[c], acc[r][c]);                    \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int c = 0; c < C; c++) F_STORE(a + r * Dh + d + c * HW, acc[r][c]);                   \
    }

/* the row's VROW-vector passes (AVX-512: a row of 128 in one), then 4-vector and 1-vector ones,
 * then the elements past the last vector */
#if defined(__AVX512F__)
#define VROW 8
#else
#define VROW 4
#endif
#define HEADS_VALUES(NAME, R, LOAD, WIDEN)                                                             \
    VALUES_PASS(NAME##_wide, R, VROW, LOAD)                                                            \
    VALUES_PASS(NAME##_four, R, 4, LOAD)                                                               \
    VALUES_PASS(NAME##_one, R, 1, LOAD)                                                                \
    static inline void NAME(float *a, const uint16_t *vb, int64_t stride, int64_t n, int64_t Dh,       \
                            int64_t S, const float *p, Fetch *f) {                                     \
        int64_t d = 0;                                                                                 \
        for (; d + VROW * HW <= Dh; d += VROW * HW) NAME##_wide(a, vb, stride, n, d, Dh, S, p, f);     \
        for (; d + 4 * HW <= Dh; d += 4 * HW) NAME##_four(a, vb, stride, n, d, Dh, S, p, f);           \
        for (; d + HW <= Dh; d += HW) NAME##_one(a, vb, stride, n, d, Dh, S, p, f);                    \
        for (int64_t t = 0; t < n; t++)                                                                \
            for (int64_t e = d; e < Dh; e++) {                                                         \
                const float x = WIDEN(vb[t * stride + e]);                                             \
                for (int r = 0; r < R; r++) a[r * Dh + e] += p[r * S + t] * x;                         \
            }                                                                                          \
    }

#define GROUP_VALUES(NAME, ONE, TWO)                                                                   \
    static void NAME(float *acc, const void *v_block, const void *v_next, int64_t n, int64_t H,        \
                     int64_t group, int64_t Dh, int64_t S, const float *p) {                           \
        const uint16_t *vb = v_block;                                                                  \
        const int64_t token_stride = H / group * Dh;                                                   \
        const int64_t passes = (H + 1) / 2 * ((Dh + VROW * HW - 1) / (VROW * HW));                     \
        Fetch f = fetch_plan(v_next, n * token_stride * 2, passes * n);                                \
        for (int64_t i = 0; i < H;) {                                                                  \
            const uint16_t *v = vb + i / group * Dh;                                                   \
            if ((i + 1) % group) {                                                                     \
                TWO(acc + i * Dh, v, token_stride, n, Dh, S, p + i * S, &f);                           \
                i += 2;                                                                                \
            } else {                                                                                   \
                ONE(acc + i * Dh, v, token_stride, n, Dh, S, p + i * S, &f);                           \
                i += 1;                                                                                \
            }                                                                                          \
        }                                                                                              \
        fetch_some(&f, f.total);                                                                       \
    }

/* scores_g<T>, values_g<T>: the functions of one 16-bit type T, widened by LOAD (vectors) and WIDEN */
#define GROUPED(T, LOAD, WIDEN)                                   \
    HEADS_DOT(dot1_g##T, 1, LOAD, WIDEN)                          \
    HEADS_DOT(dot2_g##T, 2, LOAD, WIDEN)                          \
    TILE_DOT(tile1_g##T, 1, LOAD)                                 \
    TILE_DOT(tile2_g##T, 2, LOAD)                                 \
    HEAD_SCORES(head_g##T, dot1_g##T, dot2_g##T, tile1_g##T, tile2_g##T) \
    GROUP_SCORES(scores_g##T, head_g##T)                          \
    HEADS_VALUES(values1_g##T, 1, LOAD, WIDEN)                    \
    HEADS_VALUES(values2_g##T, 2, LOAD, WIDEN)                    \
    GROUP_VALUES(values_g##T, values1_g##T, values2_g##T)

GROUPED(f16, H_LOAD, f16_to_f32)
GROUPED(bf16, BF_LOAD, bf16_to_f32)
