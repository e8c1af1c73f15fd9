/* Quantized weights on the CPU: decode GEMVs that dequantize in registers, and the row tiles a
 * prefill's matmul reads.
 *
 * y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32 row-major, W the float matrix a resident
 * quantized weight stands for (models/quantization/int4.py, fp8.py):
 *  - int4: qweight int32 [N, K / 8], nibble k of word j in row o = code of column 8j + k (0..15);
 *    scales float32 [N, K / group], zeros uint8 [N, K / group];
 *    W[o, i] = (float)(code - zero) * scale of (o, i / group).
 *  - int8: codes uint8 [N, K] (0..255); scales float32 [N, K / group], zeros int16 [N, K / group];
 *    W[o, i] = (float)(code - zero) * scale of (o, i / group).
 *  - fp8 (e4m3fn): weight uint8 [N, K]; W[o, i] = e4m3(weight[o, i]) * scale, the scale one per row
 *    (scales [N]) or per (bo x bi) block (scales [ceil(N / bo), ceil(K / bi)]).
 * Each weight value is formed exactly as the reference dequantization forms it (the same float
 * operations), so only the order of the sums differs from dequantize-then-matmul (the vector
 * paths of int8 and FP8 multiply a span's sum by its scale once: the order of a product too).
 *
 * Threads split the output rows (OpenMP, the runtime torch loaded); each thread reads its rows of
 * W once for up to ROWS_X rows of x at a time: a decode step's GEMV reads every weight byte once.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_X 8 /* rows of x multiplied per pass over W */

/* e4m3fn -> float32, exactly: (b & 0x7f) << 20 puts the exponent and mantissa where float32's
 * are (a normal number's exponent 7 too low, biased 7 instead of 127; a subnormal's mantissa a
 * float32 subnormal with the same shift); times 2^120 restores both. The sign moves to bit 31. */
static inline float e4m3(uint8_t b) {
    uint32_t bits = ((uint32_t)(b & 0x7f)) << 20;
    float f;
    memcpy(&f, &bits, 4);
    f *= 0x1p120f;
    return (b & 0x80) ? -f : f;
}

/* the scale of column block c of row o: per row (bo = 0) or per block */
static inline float fp8_scale(const float *scales, int64_t o, int64_t c, int64_t bo, int64_t block_cols) {
    return bo ? scales[(o / bo) * block_cols + c] : scales[o];
}

/* acc[m][k] += x[m][k] * w[k] for 8 columns, every row of x in the pass */
static inline void accumulate8(float acc[ROWS_X][8], const float *x, int64_t K, int64_t rows, const float *w) {
    for (int64_t m = 0; m < rows; m++)
        for (int k = 0; k < 8; k++)
            acc[m][k] += x[m * K + k] * w[k];
}

static inline void store(float acc[ROWS_X][8], float *y, int64_t N, int64_t rows, int64_t o, const float *bias) {
    for (int64_t m = 0; m < rows; m++) {
        float sum = 0.0f;
        for (int k = 0; k < 8; k++)
            sum += acc[m][k];
        y[m * N + o] = bias ? sum + bias[o] : sum;
    }
}

static inline void int4_word(uint32_t word, float zero, float scale, float *w) {
    for (int k = 0; k < 8; k++)
        w[k] = ((float)((word >> (4 * k)) & 0xF) - zero) * scale;
}

/* one pass of up to ROWS_X rows of x over every output row: `dot` adds row o's products into acc */
typedef struct {
    const void *weight;
    const float *scales;
    const uint8_t *zeros;
    int64_t group, bo, bi;
    const float *x_sums; /* int4 by 64-column chunks: [M, K / group] sums of x over each group */
} Weight;
typedef void (*RowDot)(const Weight *w, int64_t o, const float *x, int64_t m0, int64_t K, int64_t rows,
                       float acc[ROWS_X][8]);

static inline void gemv(RowDot dot, const Weight *w, const float *x, const float *bias, float *y, int64_t M,
                        int64_t N, int64_t K, int threads) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_X) {
        const int64_t rows = M - m0 < ROWS_X ? M - m0 : ROWS_X;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < N; o++) {
            float acc[ROWS_X][8] = {{0}};
            dot(w, o, x + m0 * K, m0, K, rows, acc);
            store(acc, y + m0 * N, N, rows, o, bias);
        }
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* acc[m] += x[m][8 columns] * w for every row of x in the pass; one row: two accumulators */
static inline void fma_rows(__m256 *acc, const float *x, int64_t K, int64_t rows, __m256 w) {
    for (int64_t m = 0; m < rows; m++)
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K), w, acc[m]);
}

static inline void spill(const __m256 *acc, int64_t rows, float out[ROWS_X][8]) {
    for (int64_t m = 0; m < rows; m++)
        _mm256_storeu_ps(out[m], acc[m]);
}

/* Row o over x permuted by 64-column chunks (`permute64`): in chunk c, 8 words hold columns
 * 64c + 8j + k (word j, nibble k), and x_perm holds x[64c + 8j + k] at 64c + 8k + j, so shifting
 * the chunk's 8 words right by 4k lines nibble k of every word up with 8 consecutive floats.
 * Per group: part = sum x * code, and W's group adds scale * (part - zero * sum x). */
#define NIBBLES(words, k) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 4 * (k)), _mm256_set1_epi32(15)))

/* one row of x (a decode GEMV): four chains of FMAs in flight */
static inline __m256 int4_group1(const __m256i *row, const float *xp, int64_t first, int64_t last) {
    __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps(), p2 = _mm256_setzero_ps(), p3 = _mm256_setzero_ps();
    for (int64_t c = first; c < last; c++) {
        const __m256i words = _mm256_loadu_si256(row + c);
        const float *xc = xp + c * 64;
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xc), NIBBLES(words, 0), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 8), NIBBLES(words, 1), p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 16), NIBBLES(words, 2), p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 24), NIBBLES(words, 3), p3);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 32), NIBBLES(words, 4), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 40), NIBBLES(words, 5), p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 48), NIBBLES(words, 6), p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 56), NIBBLES(words, 7), p3);
    }
    return _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3));
}

/* several rows of x: one chain per row (inlined with `rows` a constant: the chains stay in registers) */
static inline __attribute__((always_inline)) void int4_group_rows(const __m256i *row, const float *xp, int64_t K, int64_t rows, int64_t first,
                                   int64_t last, __m256 part[ROWS_X]) {
    for (int m = 0; m < ROWS_X; m++)
        part[m] = _mm256_setzero_ps();
    for (int64_t c = first; c < last; c++) {
        const __m256i words = _mm256_loadu_si256(row + c);
        for (int k = 0; k < 8; k++)
            fma_rows(part, xp + c * 64 + 8 * k, K, rows, NIBBLES(words, k));
    }
}

static void int4_row_avx2(const Weight *w, int64_t o, const float *xp, int64_t m0, int64_t K, int64_t rows,
                          float out[ROWS_X][8]) {
    const int64_t groups = K / w->group, chunks = w->group / 64;
    const __m256i *row = (const __m256i *)((const uint32_t *)w->weight + o * (K / 8));
    __m256 acc[ROWS_X], part[ROWS_X];
    float correction[ROWS_X] = {0};
    for (int m = 0; m < ROWS_X; m++)
        acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (rows == 1)
            part[0] = int4_group1(row, xp, g * chunks, (g + 1) * chunks);
        else
            switch (rows) {
#define INT4_ROWS(R) case R: int4_group_rows(row, xp, K, R, g * chunks, (g + 1) * chunks, part); break;
                INT4_ROWS(2) INT4_ROWS(3) INT4_ROWS(4) INT4_ROWS(5) INT4_ROWS(6) INT4_ROWS(7) INT4_ROWS(8)
#undef INT4_ROWS
            }
        const float scale = w->scales[o * groups + g], zero = (float)w->zeros[o * groups + g];
        for (int64_t m = 0; m < rows; m++) {
            acc[m] = _mm256_fmadd_ps(part[m], _mm256_set1_ps(scale), acc[m]);
            correction[m] += scale * zero * w->x_sums[(m0 + m) * groups + g];
        }
    }
    spill(acc, rows, out);
    for (int64_t m = 0; m < rows; m++)
        out[m][0] -= correction[m];
}

/* 8 e4m3fn bytes as floats, exactly (see `e4m3`): sign-extended, shifted so the exponent and
 * mantissa sit where float32's do, the sign's copies between them and bit 31 cleared, then 2^120 */
static inline __m256 fp8_bytes8(const uint8_t *bytes) {
    const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32((int)0x87FFFFFFu));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

/* sum x * value over columns [first, last) (multiples of 8 apart) of one row of x: four chains */
static inline __m256 fp8_span1(const uint8_t *row, const float *x, int64_t first, int64_t last) {
    __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps(), p2 = _mm256_setzero_ps(), p3 = _mm256_setzero_ps();
    int64_t i = first;
    for (; i + 32 <= last; i += 32) {
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), fp8_bytes8(row + i), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), fp8_bytes8(row + i + 8), p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), fp8_bytes8(row + i + 16), p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), fp8_bytes8(row + i + 24), p3);
    }
    for (; i < last; i += 8)
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), fp8_bytes8(row + i), p0);
    return _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3));
}

/* 8 int8 codes less their group's zero point, as floats (exact: small integers) */
static inline __m256 int8_less8(const uint8_t *bytes, __m256i zero) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(b, zero));
}

/* sum x * (code - zero) over columns [first, last) (multiples of 8 apart) of one row of x: four chains */
static inline __m256 int8_span1(const uint8_t *row, const float *x, int64_t first, int64_t last, __m256i zero) {
    __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps(), p2 = _mm256_setzero_ps(), p3 = _mm256_setzero_ps();
    int64_t i = first;
    for (; i + 32 <= last; i += 32) {
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), int8_less8(row + i, zero), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), int8_less8(row + i + 8, zero), p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), int8_less8(row + i + 16, zero), p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), int8_less8(row + i + 24, zero), p3);
    }
    for (; i < last; i += 8)
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), int8_less8(row + i, zero), p0);
    return _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3));
}

/* several rows of x: 8 codes widened once, one chain per row (inlined with `rows` a constant) */
static inline __attribute__((always_inline)) void int8_span_rows(const uint8_t *row, const float *x, int64_t K,
                                                                 int64_t rows, int64_t first, int64_t last,
                                                                 __m256i zero, __m256 part[ROWS_X]) {
    for (int m = 0; m < ROWS_X; m++)
        part[m] = _mm256_setzero_ps();
    for (int64_t i = first; i < last; i += 8)
        fma_rows(part, x + i, K, rows, int8_less8(row + i, zero));
}

/* Row o: per group, part = sum x * (code - zero), then acc += part * scale */
static void int8_row_avx2(const Weight *w, int64_t o, const float *x, int64_t K, int64_t rows,
                          float out[ROWS_X][8]) {
    const int64_t groups = K / w->group;
    const uint8_t *row = (const uint8_t *)w->weight + o * K;
    const int16_t *zeros = (const int16_t *)(const void *)w->zeros;
    __m256 acc[ROWS_X], part[ROWS_X];
    for (int m = 0; m < ROWS_X; m++)
        acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * w->group, last = first + w->group;
        const __m256i zero = _mm256_set1_epi32(zeros[o * groups + g]);
        const __m256 scale = _mm256_set1_ps(w->scales[o * groups + g]);
        if (rows == 1) {
            acc[0] = _mm256_fmadd_ps(int8_span1(row, x, first, last, zero), scale, acc[0]);
            continue;
        }
        switch (rows) {
#define INT8_ROWS(R) case R: int8_span_rows(row, x, K, R, first, last, zero, part); break;
            INT8_ROWS(2) INT8_ROWS(3) INT8_ROWS(4) INT8_ROWS(5) INT8_ROWS(6) INT8_ROWS(7) INT8_ROWS(8)
#undef INT8_ROWS
        }
        for (int64_t m = 0; m < rows; m++)
            acc[m] = _mm256_fmadd_ps(part[m], scale, acc[m]);
    }
    spill(acc, rows, out);
}

/* several rows of x: one chain per row (inlined with `rows` a constant) */
static inline __attribute__((always_inline)) void fp8_span_rows(const uint8_t *row, const float *x, int64_t K,
                                                                int64_t rows, int64_t first, int64_t last,
                                                                __m256 part[ROWS_X]) {
    for (int m = 0; m < ROWS_X; m++)
        part[m] = _mm256_setzero_ps();
    for (int64_t i = first; i < last; i += 8)
        fma_rows(part, x + i, K, rows, fp8_bytes8(row + i));
}

/* Row o: per scale's span of columns (the row, or a block's), part = sum x * value, then
 * acc += part * scale */
static void fp8_row_avx2(const Weight *w, int64_t o, const float *x, int64_t K, int64_t rows,
                         float out[ROWS_X][8]) {
    const int64_t step = w->bo ? w->bi : K, block_cols = w->bo ? (K + w->bi - 1) / w->bi : 1;
    const uint8_t *row = (const uint8_t *)w->weight + o * K;
    __m256 acc[ROWS_X], part[ROWS_X];
    for (int m = 0; m < ROWS_X; m++)
        acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c * step < K; c++) {
        const int64_t first = c * step, last = (c + 1) * step < K ? (c + 1) * step : K;
        if (rows == 1) {
            part[0] = fp8_span1(row, x, first, last);
        } else {
            switch (rows) {
#define FP8_ROWS(R) case R: fp8_span_rows(row, x, K, R, first, last, part); break;
                FP8_ROWS(2) FP8_ROWS(3) FP8_ROWS(4) FP8_ROWS(5) FP8_ROWS(6) FP8_ROWS(7) FP8_ROWS(8)
#undef FP8_ROWS
            }
        }
        const __m256 scale = _mm256_set1_ps(fp8_scale(w->scales, o, c, w->bo, block_cols));
        for (int64_t m = 0; m < rows; m++)
            acc[m] = _mm256_fmadd_ps(part[m], scale, acc[m]);
    }
    spill(acc, rows, out);
}
#endif

/* row o's products without vector code: a word's 8 columns at a time */
static void int4_row_scalar(const Weight *w, int64_t o, const float *x, int64_t K, int64_t rows,
                            float acc[ROWS_X][8]) {
    const int64_t groups = K / w->group;
    const uint32_t *row = (const uint32_t *)w->weight + o * (K / 8);
    float dq[8];
    for (int64_t j = 0; j < K / 8; j++) {
        const int64_t g = 8 * j / w->group;
        int4_word(row[j], (float)w->zeros[o * groups + g], w->scales[o * groups + g], dq);
        accumulate8(acc, x + 8 * j, K, rows, dq);
    }
}

static void int4_row(const Weight *w, int64_t o, const float *x, int64_t m0, int64_t K, int64_t rows,
                     float acc[ROWS_X][8]) {
#ifdef __AVX2__
    if (w->x_sums) {
        int4_row_avx2(w, o, x, m0, K, rows, acc);
        return;
    }
#endif
    int4_row_scalar(w, o, x, K, rows, acc);
}

/* x [M, K] permuted by 64-column chunks (see `int4_row_avx2`), and its sums per group [M, K / group] */
static void permute64(const float *x, float *xp, float *sums, int64_t M, int64_t K, int64_t group) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < K; c += 64)
            for (int j = 0; j < 8; j++)
                for (int k = 0; k < 8; k++)
                    xp[m * K + c + 8 * k + j] = x[m * K + c + 8 * j + k];
        for (int64_t g = 0; g < K / group; g++) {
            float sum = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++)
                sum += x[m * K + i];
            sums[m * (K / group) + g] = sum;
        }
    }
}

int mmserve_int4_gemv_f32(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                          const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group,
                          int threads) {
    if (K % 8 || group % 8 || K % group)
        return 1;
    Weight w = {qweight, scales, zeros, group, 0, 0, NULL};
#ifdef __AVX2__
    if (group % 64 == 0) {
        float *xp = malloc(sizeof(float) * (M * K + M * (K / group)));
        if (!xp)
            return 2;
        permute64(x, xp, xp + M * K, M, K, group);
        w.x_sums = xp + M * K;
        gemv(int4_row, &w, xp, bias, y, M, N, K, threads);
        free(xp);
        return 0;
    }
#endif
    gemv(int4_row, &w, x, bias, y, M, N, K, threads);
    return 0;
}

int mmserve_int4_dequant_rows(const int32_t *qweight, const float *scales, const uint8_t *zeros, float *out,
                              int64_t first, int64_t count, int64_t K, int64_t group, int threads) {
    if (K % 8 || group % 8 || K % group)
        return 1;
    const int64_t words = K / 8, groups = K / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < count; r++) {
        const int64_t o = first + r;
        const uint32_t *row = (const uint32_t *)qweight + o * words;
        for (int64_t g = 0; g < groups; g++) { /* a group's words: a loop the compiler vectorizes */
            const float zero = (float)zeros[o * groups + g], scale = scales[o * groups + g];
            for (int64_t j = g * group / 8; j < (g + 1) * group / 8; j++)
                int4_word(row[j], zero, scale, out + r * K + 8 * j);
        }
    }
    return 0;
}

/* row o's products without vector code: 8 columns at a time */
static void fp8_row_scalar(const Weight *w, int64_t o, const float *x, int64_t K, int64_t rows,
                           float acc[ROWS_X][8]) {
    const int64_t block_cols = w->bo ? (K + w->bi - 1) / w->bi : 1;
    const uint8_t *row = (const uint8_t *)w->weight + o * K;
    float dq[8];
    for (int64_t i = 0; i < K; i += 8) {
        const float scale = fp8_scale(w->scales, o, w->bo ? i / w->bi : 0, w->bo, block_cols);
        for (int k = 0; k < 8; k++)
            dq[k] = e4m3(row[i + k]) * scale;
        accumulate8(acc, x + i, K, rows, dq);
    }
}

static void fp8_row(const Weight *w, int64_t o, const float *x, int64_t m0, int64_t K, int64_t rows,
                    float acc[ROWS_X][8]) {
    (void)m0;
#ifdef __AVX2__
    fp8_row_avx2(w, o, x, K, rows, acc);
    return;
#endif
    fp8_row_scalar(w, o, x, K, rows, acc);
}

int mmserve_fp8_gemv_f32(const float *x, const uint8_t *weight, const float *scales, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int64_t bo, int64_t bi, int threads) {
    if (K % 8 || (bo && bi % 8))
        return 1;
    const Weight w = {weight, scales, NULL, 0, bo, bi, NULL};
    gemv(fp8_row, &w, x, bias, y, M, N, K, threads);
    return 0;
}

int mmserve_fp8_dequant_rows(const uint8_t *weight, const float *scales, float *out, int64_t first, int64_t count,
                             int64_t K, int64_t bo, int64_t bi, int threads) {
    const int64_t block_cols = bo ? (K + bi - 1) / bi : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < count; r++) {
        const int64_t o = first + r, span = bo ? bi : K;
        for (int64_t c = 0; c * span < K; c++) { /* the columns one scale covers: a loop the compiler vectorizes */
            const float scale = fp8_scale(scales, o, c, bo, block_cols);
            const int64_t last = (c + 1) * span < K ? (c + 1) * span : K;
            for (int64_t i = c * span; i < last; i++)
                out[r * K + i] = e4m3(weight[o * K + i]) * scale;
        }
    }
    return 0;
}

/* row o's products without vector code: 8 columns at a time */
static void int8_row_scalar(const Weight *w, int64_t o, const float *x, int64_t K, int64_t rows,
                            float acc[ROWS_X][8]) {
    const int64_t groups = K / w->group;
    const uint8_t *row = (const uint8_t *)w->weight + o * K;
    const int16_t *zeros = (const int16_t *)(const void *)w->zeros;
    float dq[8];
    for (int64_t i = 0; i < K; i += 8) {
        const int64_t g = i / w->group;
        const int zero = zeros[o * groups + g];
        const float scale = w->scales[o * groups + g];
        for (int k = 0; k < 8; k++)
            dq[k] = (float)(row[i + k] - zero) * scale;
        accumulate8(acc, x + i, K, rows, dq);
    }
}

static void int8_row(const Weight *w, int64_t o, const float *x, int64_t m0, int64_t K, int64_t rows,
                     float acc[ROWS_X][8]) {
    (void)m0;
#ifdef __AVX2__
    int8_row_avx2(w, o, x, K, rows, acc);
    return;
#endif
    int8_row_scalar(w, o, x, K, rows, acc);
}

int mmserve_int8_gemv_f32(const float *x, const uint8_t *codes, const float *scales, const int16_t *zeros,
                          const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group,
                          int threads) {
    if (K % 8 || group % 8 || K % group)
        return 1;
    const Weight w = {codes, scales, (const uint8_t *)(const void *)zeros, group, 0, 0, NULL};
    gemv(int8_row, &w, x, bias, y, M, N, K, threads);
    return 0;
}

int mmserve_int8_dequant_rows(const uint8_t *codes, const float *scales, const int16_t *zeros, float *out,
                              int64_t first, int64_t count, int64_t K, int64_t group, int threads) {
    if (K % group)
        return 1;
    const int64_t groups = K / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < count; r++) {
        const int64_t o = first + r;
        for (int64_t g = 0; g < groups; g++) { /* a group's columns: a loop the compiler vectorizes */
            const int zero = zeros[o * groups + g];
            const float scale = scales[o * groups + g];
            for (int64_t i = g * group; i < (g + 1) * group; i++)
                out[r * K + i] = (float)(codes[o * K + i] - zero) * scale;
        }
    }
    return 0;
}
