/* Quantized decode GEMVs with AVX-512: y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32,
 * W the resident int4 or FP8 weight of models/quantization/int4.py and fp8.py (the layouts as in
 * quant_gemv.c, which serves machines without AVX-512 and the shapes these functions refuse).
 *
 * Each weight vector is decoded once for a pass of up to 8 (int4) or 4 (FP8) rows of x, in
 * chains of FMAs per row of x; with several rows of x, int4 takes two rows of W at once (each x
 * vector loaded once for both). Otherwise each row of W is read as one stream: more streams at
 * once defeat the hardware prefetcher (measured 2x slower: FP8 at any rows of x, int4 at one),
 * as do FP8 passes of 8 rows. x is copied 64-byte aligned, its rows PAD floats more than K apart
 * (rows 4 KiB apart would share L1 sets). Threads (OpenMP, torch's runtime) split W's rows.
 *
 * Each int4 weight is the value the reference dequantization forms ((code - zero) * scale, from
 * a 16-entry table per group); an FP8 scale multiplies the sum of x * e4m3 over the columns it
 * covers. Otherwise only the order of the sums differs from dequantize-then-matmul.
 * Every function returns 0 when done, nonzero (nothing written) when the shapes are not its own
 * or the library was built without AVX-512 (`mmserve_q512_built` says which).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RM 8 /* rows of x per pass over W, at most */
#define PAD 16   /* floats between x's rows beyond K */
#define PREFETCH 16384 /* bytes ahead in an int4 W's stream a chunk prefetches (as int4_q8_gemv.c) */

typedef struct {
    const void *weight;
    const float *scales;
    const uint8_t *zeros;
    const float *x; /* the padded copy, rows K + PAD apart (int4: permuted, see `padded`) */
    float *y;
    int64_t N, K, group, bo, bi;
} Gemv;

#ifdef __AVX512F__
#include <immintrin.h>

int mmserve_q512_built(void) { return 1; }

/* x [M, K] into rows K + PAD apart; with `permute`, by 128-column chunks:
 * xp[128c + 16k + j] = x[128c + 8j + k], so that lane j of chunk c's 16 int32 words holds
 * column 128c + 8j + k in nibble k */
static float *padded(const float *x, int64_t M, int64_t K, int permute) {
    float *xp = aligned_alloc(64, sizeof(float) * M * (K + PAD)); /* K % 16 == 0: every row 64-byte aligned */
    for (int64_t m = 0; xp && m < M; m++) {
        float *to = xp + m * (K + PAD);
        const float *from = x + m * K;
        for (int64_t c = 0; permute && c < K; c += 128)
            for (int j = 0; j < 16; j++)
                for (int k = 0; k < 8; k++)
                    to[c + 16 * k + j] = from[c + 8 * j + k];
        if (!permute)
            memcpy(to, from, sizeof(float) * K);
    }
    return xp;
}

/* the 16 values a group's codes stand for: (code - zero) * scale, as the reference forms them */
static inline __m512 int4_table(float scale, uint8_t zero) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps((float)zero)), _mm512_set1_ps(scale));
}

/* y[m, o + r] += the lanes of acc[r][m][0 .. C - 1], for RO rows of W and RM rows of x */
#define ADD_ROWS(RO, RM, C, acc, g, o)                                                             \
    for (int r = 0; r < RO; r++)                                                                   \
        for (int m = 0; m < RM; m++) {                                                             \
            for (int j = 1; j < C; j++)                                                            \
                acc[r][m][0] = _mm512_add_ps(acc[r][m][0], acc[r][m][j]);                          \
            g->y[m * g->N + o + r] += _mm512_reduce_add_ps(acc[r][m][0]);                          \
        }

/* Rows o .. o + RO - 1 of an int4 W, columns [first, last) (whole groups), against RM rows of x:
 * per group, each row's table; per chunk, each row's 16 words, and nibble k of every lane indexes
 * the table (vpermps reads an index's low 4 bits: shifting right by 4k selects it), into chain
 * k % C of each (row of W, row of x). */
#define INT4_ROW(RO, RM, C)                                                                        \
    static void int4_row_##RO##_##RM(const Gemv *g, int64_t o, int64_t first, int64_t last) {      \
        const int64_t groups = g->K / g->group, chunks = g->group / 128, ld = g->K + PAD;          \
        const uint32_t *row = (const uint32_t *)g->weight + o * (g->K / 8);                        \
        __m512 acc[RO][RM][C], table[RO];                                                          \
        for (int r = 0; r < RO; r++)                                                               \
            for (int m = 0; m < RM; m++)                                                           \
                for (int j = 0; j < C; j++)                                                        \
                    acc[r][m][j] = _mm512_setzero_ps();                                            \
        for (int64_t q = first / g->group; q < last / g->group; q++) {                             \
            for (int r = 0; r < RO; r++)                                                           \
                table[r] = int4_table(g->scales[(o + r) * groups + q], g->zeros[(o + r) * groups + q]); \
            for (int64_t c = q * chunks; c < (q + 1) * chunks; c++) {                              \
                __m512i w[RO];                                                                     \
                for (int r = 0; r < RO; r++) {                                                     \
                    w[r] = _mm512_loadu_si512(row + r * (g->K / 8) + 16 * c);                      \
                    _mm_prefetch((const char *)(row + r * (g->K / 8) + 16 * c) + PREFETCH, _MM_HINT_T0); \
                }                                                                                  \
                _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {                              \
                    __m512 v[RO];                                                                  \
                    for (int r = 0; r < RO; r++)                                                   \
                        v[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(w[r], 4 * k), table[r]);    \
                    for (int m = 0; m < RM; m++) {                                                 \
                        const __m512 xv = _mm512_loadu_ps(g->x + m * ld + 128 * c + 16 * k);       \
                        for (int r = 0; r < RO; r++)                                               \
                            acc[r][m][k % C] = _mm512_fmadd_ps(xv, v[r], acc[r][m][k % C]);        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        ADD_ROWS(RO, RM, C, acc, g, o)                                                             \
    }

/* 16 e4m3fn bytes as floats, exactly (quant_gemv.c's `e4m3`): sign-extended, shifted so the
 * exponent and mantissa sit where float32's do, the sign's copies cleared, then times 2^120 */
static inline __m512 fp8_bytes16(const uint8_t *bytes) {
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32((int)0x87FFFFFFu));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

/* Row o of an FP8 W, columns [first, last), against RM rows of x, C chains per row of x: per span
 * of columns one scale covers (a block's bi, or the segment for a per-row scale),
 * part = sum x * e4m3, then acc += part * scale */
#define FP8_ROW(RM, C)                                                                             \
    static void fp8_row_##RM(const Gemv *g, int64_t o, int64_t first, int64_t last) {              \
        const int64_t span = g->bo ? g->bi : last - first, ld = g->K + PAD;                        \
        const int64_t block_cols = g->bo ? (g->K + g->bi - 1) / g->bi : 1;                         \
        const uint8_t *row = (const uint8_t *)g->weight + o * g->K;                                \
        __m512 acc[RM][1], part[RM][C];                                                            \
        for (int m = 0; m < RM; m++)                                                               \
            acc[m][0] = _mm512_setzero_ps();                                                       \
        for (int64_t start = first; start < last; start += span) {                                 \
            const int64_t stop = start + span < last ? start + span : last;                        \
            int64_t i = start;                                                                     \
            for (int m = 0; m < RM; m++)                                                           \
                for (int j = 0; j < C; j++)                                                        \
                    part[m][j] = _mm512_setzero_ps();                                              \
            for (; i + 16 * C <= stop; i += 16 * C)                                                \
                for (int j = 0; j < C; j++) {                                                      \
                    const __m512 v = fp8_bytes16(row + i + 16 * j);                                \
                    for (int m = 0; m < RM; m++)                                                   \
                        part[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(g->x + m * ld + i + 16 * j), v, part[m][j]); \
                }                                                                                  \
            for (; i < stop; i += 16) {                                                            \
                const __m512 v = fp8_bytes16(row + i);                                             \
                for (int m = 0; m < RM; m++)                                                       \
                    part[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(g->x + m * ld + i), v, part[m][0]); \
            }                                                                                      \
            const float s = g->bo ? g->scales[(o / g->bo) * block_cols + start / g->bi] : g->scales[o]; \
            for (int m = 0; m < RM; m++) {                                                         \
                for (int j = 1; j < C; j++)                                                        \
                    part[m][0] = _mm512_add_ps(part[m][0], part[m][j]);                            \
                acc[m][0] = _mm512_fmadd_ps(part[m][0], _mm512_set1_ps(s), acc[m][0]);             \
            }                                                                                      \
        }                                                                                          \
        ADD_ROWS(1, RM, 1, ((__m512 (*)[RM][1])acc), g, o)                                                                  \
    }

INT4_ROW(1, 1, 4) INT4_ROW(2, 2, 2) INT4_ROW(2, 3, 1) INT4_ROW(2, 4, 1) INT4_ROW(2, 5, 1) INT4_ROW(2, 6, 1) INT4_ROW(2, 7, 1) INT4_ROW(2, 8, 1)
FP8_ROW(1, 4) FP8_ROW(2, 2) FP8_ROW(3, 2) FP8_ROW(4, 2)

typedef void (*RowFn)(const Gemv *, int64_t, int64_t, int64_t);
/* a format's row functions by the rows of x in a pass (1 .. `most`), and the rows of W each takes */
typedef struct {
    RowFn fn[MAX_RM];
    int rows_of_w[MAX_RM];
    int most;
} Kernels;
static const Kernels INT4 = {{int4_row_1_1, int4_row_2_2, int4_row_2_3, int4_row_2_4, int4_row_2_5, int4_row_2_6,
                              int4_row_2_7, int4_row_2_8},
                             {1, 2, 2, 2, 2, 2, 2, 2}, 8};
static const Kernels FP8 = {{fp8_row_1, fp8_row_2, fp8_row_3, fp8_row_4}, {1, 1, 1, 1}, 4};

/* y = bias (or 0), then every pass of up to `k->most` rows of x added into it */
static void run(Gemv g, const Kernels *k, const float *bias, int64_t M, int threads) {
    float *const y = g.y;
    const float *const x = g.x;
    for (int64_t i = 0; i < M * g.N; i++)
        y[i] = bias ? bias[i % g.N] : 0.0f;
#pragma omp parallel num_threads(threads) firstprivate(g)
    for (int64_t m0 = 0; m0 < M; m0 += k->most) {
        const int64_t count = M - m0 < k->most ? M - m0 : k->most;
        g.x = x + m0 * (g.K + PAD);
        g.y = y + m0 * g.N;
#pragma omp for schedule(static) nowait
        for (int64_t o = 0; o < g.N; o += k->rows_of_w[count - 1]) /* the same rows on a thread in every pass */
            k->fn[count - 1](&g, o, 0, g.K);
    }
}

int mmserve_int4_gemv512(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    if (group % 128 || K % group || (M > 1 && N % 2))
        return 1;
    float *xp = padded(x, M, K, 1);
    if (!xp)
        return 2;
    const Gemv g = {qweight, scales, zeros, xp, y, N, K, group, 0, 0};
    run(g, &INT4, bias, M, threads);
    free(xp);
    return 0;
}

int mmserve_fp8_gemv512(const float *x, const uint8_t *weight, const float *scales, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t bo, int64_t bi, int threads) {
    if (K % 16 || (bo && bi % 16))
        return 1;
    float *xp = padded(x, M, K, 0);
    if (!xp)
        return 2;
    const Gemv g = {weight, scales, NULL, xp, y, N, K, 0, bo, bi};
    run(g, &FP8, bias, M, threads);
    free(xp);
    return 0;
}

#else

int mmserve_q512_built(void) { return 0; }

int mmserve_int4_gemv512(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    return 1;
}

int mmserve_fp8_gemv512(const float *x, const uint8_t *weight, const float *scales, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t bo, int64_t bi, int threads) {
    return 1;
}

#endif
