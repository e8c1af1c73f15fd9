/* Quantized decode GEMVs with AVX-512: y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32,
 * W the resident int4 or FP8 weight of models/quantization/int4.py and fp8.py (the layouts as in
 * quant_gemv.c, which serves machines without AVX-512 and the shapes these functions refuse).
 *
 * Register blocking: a block of RO rows of W meets RM rows of x in RO x RM accumulators, so each
 * weight vector is decoded once per RM rows of x and each x vector loaded once per RO rows of W.
 * Threads (OpenMP, torch's runtime) split W's rows in blocks; a pass over W takes up to MAX_RM
 * rows of x, so a decode step of up to MAX_RM sequences reads every weight byte once.
 *
 * Each int4 weight is the value the reference dequantization forms ((code - zero) * scale, from
 * a 16-entry table per group); an FP8 scale multiplies the sum of x * e4m3 over the columns it
 * covers. Otherwise only the order of the sums differs from dequantize-then-matmul.
 * Every function returns 0 when done, nonzero (nothing written) when the shapes are not its own
 * or the library was built without AVX-512 (`mmserve_q512_built` says which).
 */
#include <stdint.h>
#include <stdlib.h>

#define MAX_RM 8 /* rows of x per pass over W */

#ifdef __AVX512F__
#include <immintrin.h>

int mmserve_q512_built(void) { return 1; }

/* x permuted by 128-column chunks: xp[128c + 16k + j] = x[128c + 8j + k], so that in chunk c
 * lane j of word vector c holds column 128c + 8j + k in nibble k (16 int32 words per chunk) */
static void permute128(const float *x, float *xp, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K; c += 128)
            for (int j = 0; j < 16; j++)
                for (int k = 0; k < 8; k++)
                    xp[m * K + c + 16 * k + j] = x[m * K + c + 8 * j + k];
}

/* the 16 values a group's codes stand for: (code - zero) * scale, as the reference forms them */
static inline __m512 int4_table(float scale, uint8_t zero) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps((float)zero)), _mm512_set1_ps(scale));
}

/* y[m, o + r] = acc[r][m] summed (+ bias) for the block's RO rows and RM rows of x */
#define STORE_BLOCK(RO, RM, acc, y, N, o, bias, rowscale)                                       \
    for (int r = 0; r < RO; r++)                                                               \
        for (int m = 0; m < RM; m++) {                                                         \
            float sum = _mm512_reduce_add_ps(acc[r][m]);                                       \
            sum = (rowscale) ? sum * (rowscale)[o + r] : sum;                                  \
            y[m * N + o + r] = bias ? sum + bias[o + r] : sum;                                 \
        }

/* Rows o .. o + RO - 1 of an int4 W against RM rows of permuted x: per group, each row's table;
 * per chunk, each row's 16 words; nibble k of every lane indexes the table (vpermps reads an
 * index's low 4 bits, so shifting the words right by 4k selects nibble k). */
#define INT4_BLOCK(RO, RM)                                                                          \
    static void int4_block_##RO##_##RM(const uint32_t *qw, const float *scales, const uint8_t *zeros, \
                                       const float *xp, const float *bias, float *y, int64_t N,       \
                                       int64_t K, int64_t group, int64_t o) {                         \
        const int64_t words = K / 8, groups = K / group, chunks = group / 128;                      \
        __m512 acc[RO][RM], table[RO], xv;                                                          \
        __m512i w[RO];                                                                              \
        for (int r = 0; r < RO; r++)                                                                \
            for (int m = 0; m < RM; m++)                                                            \
                acc[r][m] = _mm512_setzero_ps();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                      \
            for (int r = 0; r < RO; r++)                                                            \
                table[r] = int4_table(scales[(o + r) * groups + g], zeros[(o + r) * groups + g]);   \
            for (int64_t c = g * chunks; c < (g + 1) * chunks; c++) {                               \
                for (int r = 0; r < RO; r++)                                                        \
                    w[r] = _mm512_loadu_si512(qw + (o + r) * words + 16 * c);                       \
                _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {                               \
                    __m512 v[RO];                                                                   \
                    for (int r = 0; r < RO; r++)                                                    \
                        v[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(w[r], 4 * k), table[r]);     \
                    for (int m = 0; m < RM; m++) {                                                  \
                        xv = _mm512_loadu_ps(xp + m * K + 128 * c + 16 * k);                        \
                        for (int r = 0; r < RO; r++)                                                \
                            acc[r][m] = _mm512_fmadd_ps(xv, v[r], acc[r][m]);                       \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        STORE_BLOCK(RO, RM, acc, y, N, o, bias, (const float *)NULL)                                \
    }

/* 16 e4m3fn bytes as floats, exactly (quant_gemv.c's `e4m3`): sign-extended, shifted so the
 * exponent and mantissa sit where float32's do, the sign's copies cleared, then times 2^120 */
static inline __m512 fp8_bytes16(const uint8_t *bytes) {
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32((int)0x87FFFFFFu));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

/* Rows o .. o + RO - 1 of an FP8 W against RM rows of x, 16 columns at a time, per span of
 * columns one scale covers (the row, or a block's bi columns): part = sum x * e4m3 over the span,
 * then acc += part * scale (a per-row scale: once, at the end). */
#define FP8_BLOCK(RO, RM)                                                                           \
    static void fp8_block_##RO##_##RM(const uint8_t *weight, const float *scales, const float *x,    \
                                      const float *bias, float *y, int64_t N, int64_t K, int64_t bo,  \
                                      int64_t bi, int64_t o) {                                        \
        const int64_t span = bo ? bi : K, block_cols = bo ? (K + bi - 1) / bi : 1;                   \
        __m512 acc[RO][RM], part[RO][RM], v[RO], xv;                                                \
        for (int r = 0; r < RO; r++)                                                                \
            for (int m = 0; m < RM; m++)                                                            \
                acc[r][m] = _mm512_setzero_ps();                                                    \
        for (int64_t first = 0; first < K; first += span) {                                        \
            const int64_t last = first + span < K ? first + span : K;                               \
            for (int r = 0; r < RO; r++)                                                            \
                for (int m = 0; m < RM; m++)                                                        \
                    part[r][m] = _mm512_setzero_ps();                                               \
            for (int64_t i = first; i < last; i += 16) {                                            \
                for (int r = 0; r < RO; r++)                                                        \
                    v[r] = fp8_bytes16(weight + (o + r) * K + i);                                   \
                for (int m = 0; m < RM; m++) {                                                      \
                    xv = _mm512_loadu_ps(x + m * K + i);                                            \
                    for (int r = 0; r < RO; r++)                                                    \
                        part[r][m] = _mm512_fmadd_ps(xv, v[r], part[r][m]);                         \
                }                                                                                   \
            }                                                                                       \
            for (int r = 0; r < RO; r++) {                                                          \
                const __m512 scale = _mm512_set1_ps(bo ? scales[((o + r) / bo) * block_cols + first / bi] \
                                                       : scales[o + r]);                            \
                for (int m = 0; m < RM; m++)                                                        \
                    acc[r][m] = _mm512_fmadd_ps(part[r][m], scale, acc[r][m]);                      \
            }                                                                                       \
        }                                                                                           \
        STORE_BLOCK(RO, RM, acc, y, N, o, bias, (const float *)NULL)                                \
    }

INT4_BLOCK(4, 1) INT4_BLOCK(4, 2) INT4_BLOCK(4, 3) INT4_BLOCK(4, 4)
INT4_BLOCK(2, 5) INT4_BLOCK(2, 6) INT4_BLOCK(2, 7) INT4_BLOCK(2, 8)
FP8_BLOCK(4, 1) FP8_BLOCK(4, 2) FP8_BLOCK(2, 3) FP8_BLOCK(2, 4)
FP8_BLOCK(1, 5) FP8_BLOCK(1, 6) FP8_BLOCK(1, 7) FP8_BLOCK(1, 8)

typedef void (*Int4Block)(const uint32_t *, const float *, const uint8_t *, const float *, const float *, float *,
                          int64_t, int64_t, int64_t, int64_t);
typedef void (*Fp8Block)(const uint8_t *, const float *, const float *, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t);
static const Int4Block INT4_BLOCKS[MAX_RM] = {int4_block_4_1, int4_block_4_2, int4_block_4_3, int4_block_4_4,
                                              int4_block_2_5, int4_block_2_6, int4_block_2_7, int4_block_2_8};
static const Fp8Block FP8_BLOCKS[MAX_RM] = {fp8_block_4_1, fp8_block_4_2, fp8_block_2_3, fp8_block_2_4,
                                            fp8_block_1_5, fp8_block_1_6, fp8_block_1_7, fp8_block_1_8};
static const int INT4_RO[MAX_RM] = {4, 4, 4, 4, 2, 2, 2, 2}, FP8_RO[MAX_RM] = {4, 4, 2, 2, 1, 1, 1, 1};

int mmserve_int4_gemv512(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    if (group % 128 || K % group || N % 4)
        return 1;
    float *xp = malloc(sizeof(float) * M * K);
    if (!xp)
        return 2;
    permute128(x, xp, M, K);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_RM) {
        const int64_t rows = M - m0 < MAX_RM ? M - m0 : MAX_RM, ro = INT4_RO[rows - 1];
        const Int4Block block = INT4_BLOCKS[rows - 1];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < N; o += ro)
            block((const uint32_t *)qweight, scales, zeros, xp + m0 * K, bias, y + m0 * N, N, K, group, o);
    }
    free(xp);
    return 0;
}

int mmserve_fp8_gemv512(const float *x, const uint8_t *weight, const float *scales, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t bo, int64_t bi, int threads) {
    if (K % 16 || N % 4 || (bo && bi % 16))
        return 1;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_RM) {
        const int64_t rows = M - m0 < MAX_RM ? M - m0 : MAX_RM, ro = FP8_RO[rows - 1];
        const Fp8Block block = FP8_BLOCKS[rows - 1];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < N; o += ro)
            block(weight, scales, x + m0 * K, bias, y + m0 * N, N, K, bo, bi, o);
    }
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
