/* Scores and values of float32 queries over a 16-bit KV cache (`--kv-cache-dtype`), by query
 * head group: each key's and value's row is loaded and widened once for two query heads that
 * share its KV head, and a head's value sums stay in registers over a block's tokens (4 vectors
 * of its row a pass), stored once a block. Included by paged_decode.c after its vector macros (HW
 * lanes of hvec: H_LOAD, F_LOAD, F_STORE, H_FMA, H_SET1, H_ZERO, H_SUM), `fetch_key` and its
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

#define GROUP_SCORES(NAME, ONE, TWO)                                                                   \
    static void NAME(const float *q, const void *k_block, const void *k_next, int64_t n, int64_t H,    \
                     int64_t group, int64_t Dh, int64_t S, float scale, float *scores) {               \
        const uint16_t *kb = k_block;                                                                  \
        const int64_t token_stride = H / group * Dh, lines = (token_stride * 2 + 63) / 64;             \
        for (int64_t t = 0; t < n; t++) {                                                              \
            fetch_key(k_next, t, lines);                                                               \
            for (int64_t i = 0; i < H;) {                                                              \
                const uint16_t *k = kb + t * token_stride + i / group * Dh;                            \
                if ((i + 1) % group) { /* heads i and i + 1 share a KV head */                         \
                    TWO(q + i * Dh, k, Dh, S, scale, scores + i * S + t);                              \
                    i += 2;                                                                            \
                } else {                                                                               \
                    ONE(q + i * Dh, k, Dh, S, scale, scores + i * S + t);                              \
                    i += 1;                                                                            \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }

/* a[x * Dh + d] += sum_t p[x * S + t] * v_t[d] for the R (1 or 2) query heads x of acc rows a,
 * over a block's n tokens of one KV head (vb: its row in the block's first token; rows `stride`
 * apart), 4 vectors of each row in registers a pass */
#define HEADS_VALUES(NAME, R, LOAD, WIDEN)                                                             \
    static inline void NAME(float *a, const uint16_t *vb, int64_t stride, int64_t n, int64_t Dh,       \
                            int64_t S, const float *p) {                                               \
        int64_t d = 0;                                                                                 \
        for (; d + 4 * HW <= Dh; d += 4 * HW) {                                                        \
            hvec acc[R][4];                                                                            \
            for (int r = 0; r < R; r++)                                                                \
                for (int c = 0; c < 4; c++) acc[r][c] = F_LOAD(a + r * Dh + d + c * HW);               \
            for (int64_t t = 0; t < n; t++) {                                                          \
                const uint16_t *v = vb + t * stride + d;                                               \
                hvec x[4];                                                                             \
                for (int c = 0; c < 4; c++) x[c] = LOAD(v + c * HW);                                   \
                for (int r = 0; r < R; r++) {                                                          \
                    const hvec w = H_SET1(p[r * S + t]);                                               \
                    for (int c = 0; c < 4; c++) acc[r][c] = H_FMA(w, x[c], acc[r][c]);                 \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++)                                                                \
                for (int c = 0; c < 4; c++) F_STORE(a + r * Dh + d + c * HW, acc[r][c]);               \
        }                                                                                              \
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
        const int64_t token_stride = H / group * Dh, lines = (token_stride * 2 + 63) / 64;             \
        for (int64_t t = 0; t < n; t++) fetch_key(v_next, t, lines);                                   \
        for (int64_t i = 0; i < H;) {                                                                  \
            const uint16_t *v = vb + i / group * Dh;                                                   \
            if ((i + 1) % group) {                                                                     \
                TWO(acc + i * Dh, v, token_stride, n, Dh, S, p + i * S);                               \
                i += 2;                                                                                \
            } else {                                                                                   \
                ONE(acc + i * Dh, v, token_stride, n, Dh, S, p + i * S);                               \
                i += 1;                                                                                \
            }                                                                                          \
        }                                                                                              \
    }

/* scores_g<T>, values_g<T>: the functions of one 16-bit type T, widened by LOAD (vectors) and WIDEN */
#define GROUPED(T, LOAD, WIDEN)                                   \
    HEADS_DOT(dot1_g##T, 1, LOAD, WIDEN)                          \
    HEADS_DOT(dot2_g##T, 2, LOAD, WIDEN)                          \
    GROUP_SCORES(scores_g##T, dot1_g##T, dot2_g##T)               \
    HEADS_VALUES(values1_g##T, 1, LOAD, WIDEN)                    \
    HEADS_VALUES(values2_g##T, 2, LOAD, WIDEN)                    \
    GROUP_VALUES(values_g##T, values1_g##T, values2_g##T)

GROUPED(f16, H_LOAD, f16_to_f32)
GROUPED(bf16, BF_LOAD, bf16_to_f32)
