/* Int4 weights times int8-quantized activations: the opt-in decode GEMV of
 * `--cpu-activation-quant int8` (models/quantization/q8_gemv.py). Not exact: x is rounded to int8.
 *
 * y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32, W the resident int4 weight of
 * models/quantization/int4.py: qweight int32 [N, K / 8] (nibble k of word j in row o = code of
 * column 8j + k, 0..15), scales float32 [N, G], zeros uint8 [N, G], G = K / group;
 * W[o, i] = (code - zero) * scale of (o, i / group).
 *
 * Each row of x is quantized per block of the weight's group (`quantize`): xs = max|x| * (1/127)
 * (the float32 constant), code = round-half-even(x * (127 / max|x|)) in -127..127 (all zeros for
 * a block of zeros), and the block's sum of codes kept (as xs * sum_x, `cx`). Then per row o of W:
 *   dot[g] = sum_i code_w[o, i] * code_x[i] over group g's columns (exact, in int32),
 *   y[m, o] = bias[o] + sum_g scales[o, g] * xs[m, g] * dot[g] - sum_g scales[o, g] * zeros[o, g] * cx[m, g]
 * in float32: scales * xs * (dot - zero * sum_x) up to float rounding.
 * The integers are the same on every path: AVX-512 VNNI (`vpdpbusd`: u8 weight codes x s8
 * activation codes, four products per int32 lane), AVX2 (`vpmaddubsw` into int16 pairs, at most
 * 2 * 15 * 127, then `vpmaddwd` by ones) and plain C; only the order of the float sums differs.
 *
 * The codes of x are laid out per 128-column chunk as its even columns then its odd ones
 * (xq[128c + i / 2 + 64 (i % 2)] = code of column 128c + i), so that byte b of word j's low nibbles
 * (word & 0x0F0F0F0F: columns 8j + 2b) meets the even half's byte 4j + b, and the high nibbles
 * (columns 8j + 2b + 1) the odd half's. Hence group % 128 == 0 (every published AWQ / W4A16
 * group); other groups are refused (return 1) and the caller keeps the exact GEMV.
 * Threads (OpenMP, torch's runtime) split W's rows; each pass takes up to MAX_RM rows of x and
 * reads W's row once for all of them, W's stream prefetched far ahead (the hardware's prefetcher
 * alone left a pass at ~half a read's bandwidth). Returns 0 when done, nonzero (nothing written) otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RM 8   /* rows of x per pass over W */
#define CHUNK 128  /* columns per layout chunk: 16 words, 64 bytes of codes */
#define PREFETCH 16384 /* bytes ahead in W's stream a chunk prefetches (one thread, a decoder pass: 4.1 -> 3.1 ms;
                          * 1-4 KiB gained little, 8-64 KiB alike) */

typedef struct {
    const uint32_t *qweight;
    const float *scales;
    const uint8_t *zeros;
    const int8_t *xq;    /* [M, K] codes of x in the chunk layout */
    const float *xs;     /* [M, G] scale of each block of x */
    const float *cx;     /* [M, G] xs * (the block's sum of codes): the zero point's factor */
    const float *bias;
    float *y;
    int64_t N, K, group;
} Q8;

/* the highest path this build has: 2 AVX-512 VNNI, 1 AVX2, 0 plain C */
int mmserve_q8_level(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Rows of x [M, K] into codes (the chunk layout), block scales and xs * sum of codes [M, K / group] */
static void quantize(const float *x, int64_t M, int64_t K, int64_t group, int8_t *xq, float *xs, float *cx) {
    const int64_t groups = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *from = x + m * K + g * group;
            float amax = 0.0f;
            for (int64_t i = 0; i < group; i++)
                amax = fmaxf(amax, fabsf(from[i]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int64_t i = 0; i < group; i++) {
                const int64_t col = g * group + i, r = col % CHUNK;
                float v = nearbyintf(from[i] * inv);
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                xq[m * K + col - r + r / 2 + (r % 2) * (CHUNK / 2)] = (int8_t)v;
                sum += (int32_t)v;
            }
            xs[m * groups + g] = amax * (1.0f / 127.0f);
            cx[m * groups + g] = xs[m * groups + g] * (float)sum;
        }
}

/* the zero points' term of y[m, o]: sum over groups of scale * zero * (xs * sum of x's codes) */
static inline float zero_term(const Q8 *q, int64_t o, int64_t m) {
    const int64_t G = q->K / q->group;
    const float *s = q->scales + o * G, *cx = q->cx + m * G;
    const uint8_t *z = q->zeros + o * G;
    float t = 0.0f;
    for (int64_t g = 0; g < G; g++)
        t += s[g] * (float)z[g] * cx[g];
    return t;
}

/* y[m, o] from the sum over groups of scale * xs * dot */
static inline void finish(const Q8 *q, int64_t o, int64_t m, float part) {
    q->y[m * q->N + o] = (q->bias ? q->bias[o] : 0.0f) + part - zero_term(q, o, m);
}

/* one word's 8 codes against their 8 x codes (the layout above): exact */
static inline int32_t word_dot(uint32_t word, const int8_t *even, const int8_t *odd) {
    int32_t s = 0;
    for (int b = 0; b < 4; b++)
        s += (int32_t)((word >> (8 * b)) & 15) * even[b] + (int32_t)((word >> (8 * b + 4)) & 15) * odd[b];
    return s;
}

/* Row o of W against `rows` rows of x, plain C */
static void row_plain(const Q8 *q, int64_t o, int64_t m0, int64_t rows) {
    const int64_t groups = q->K / q->group, per = q->group / CHUNK;
    const uint32_t *row = q->qweight + o * (q->K / 8);
    for (int64_t m = m0; m < m0 + rows; m++) {
        float part = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t dot = 0;
            for (int64_t c = g * per; c < (g + 1) * per; c++) {
                const int8_t *xc = q->xq + m * q->K + c * CHUNK;
                for (int j = 0; j < 16; j++)
                    dot += word_dot(row[16 * c + j], xc + 4 * j, xc + CHUNK / 2 + 4 * j);
            }
            part += q->scales[o * groups + g] * q->xs[m * groups + g] * (float)dot;
        }
        finish(q, o, m, part);
    }
}

#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>
#endif

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Row o of W against RM rows of x from m0, AVX2: per half chunk (8 words, 64 columns), the low and
 * high nibbles' maddubs summed in int16 (at most 4 * 15 * 127), then to int32 by madd with ones;
 * per group, the lanes as floats times f into a float vector; the zero points' term after the row */
#define ROW_AVX2(RM)                                                                               \
    static void row_avx2_##RM(const Q8 *q, int64_t o, int64_t m0) {                                \
        const int64_t G = q->K / q->group, per = q->group / CHUNK;                                 \
        const uint32_t *row = q->qweight + o * (q->K / 8);                                         \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                     \
        __m256 part[RM];                                                                           \
        for (int m = 0; m < RM; m++)                                                               \
            part[m] = _mm256_setzero_ps();                                                         \
        for (int64_t g = 0; g < G; g++) {                                                          \
            __m256i acc[RM];                                                                       \
            for (int m = 0; m < RM; m++)                                                           \
                acc[m] = _mm256_setzero_si256();                                                   \
            for (int64_t c = g * per; c < (g + 1) * per; c++)                                      \
                for (int h = 0; h < 2; h++) {                                                      \
                    _mm_prefetch((const char *)(row + 16 * c + 8 * h) + PREFETCH, _MM_HINT_T0);        \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(row + 16 * c + 8 * h)); \
                    const __m256i lo = _mm256_and_si256(w, low);                                   \
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(w, 4), low);             \
                    for (int m = 0; m < RM; m++) {                                                 \
                        const int8_t *xc = q->xq + (m0 + m) * q->K + c * CHUNK + 32 * h;           \
                        const __m256i e = _mm256_loadu_si256((const __m256i *)xc);                 \
                        const __m256i d = _mm256_loadu_si256((const __m256i *)(xc + CHUNK / 2));   \
                        const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, d)); \
                        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(s, ones));             \
                    }                                                                              \
                }                                                                                  \
            const float s = q->scales[o * G + g];                                                  \
            for (int m = 0; m < RM; m++) {                                                         \
                const float f = s * q->xs[(m0 + m) * G + g];                                       \
                part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(f), part[m]); \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < RM; m++)                                                               \
            finish(q, o, m0 + m, hsum256(part[m]));                                                \
    }
ROW_AVX2(1) ROW_AVX2(2) ROW_AVX2(3) ROW_AVX2(4) ROW_AVX2(5) ROW_AVX2(6) ROW_AVX2(7) ROW_AVX2(8)
static void (*const ROWS_AVX2[MAX_RM])(const Q8 *, int64_t, int64_t) = {
    row_avx2_1, row_avx2_2, row_avx2_3, row_avx2_4, row_avx2_5, row_avx2_6, row_avx2_7, row_avx2_8};
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Row o of W against RM rows of x from m0, AVX-512 VNNI: per chunk, two vpdpbusd per row of x (low
 * nibbles x even columns, high x odd) into the group's int32 lanes; per group, the lanes as floats
 * times f into a float vector; the zero points' term after the row (`zero_term`) */
#define ROW_512(RM)                                                                                \
    static void row_512_##RM(const Q8 *q, int64_t o, int64_t m0) {                                 \
        const int64_t G = q->K / q->group, per = q->group / CHUNK;                                 \
        const uint32_t *row = q->qweight + o * (q->K / 8);                                         \
        const __m512i low = _mm512_set1_epi8(15);                                                  \
        __m512 part[RM];                                                                           \
        for (int m = 0; m < RM; m++)                                                               \
            part[m] = _mm512_setzero_ps();                                                         \
        __m512i acc[RM];                                                                           \
        for (int m = 0; m < RM; m++)                                                               \
            acc[m] = _mm512_setzero_si512();                                                       \
        for (int64_t c = 0, g = 0, left = per; c < G * per; c++) {                                 \
            _mm_prefetch((const char *)(row + 16 * c) + PREFETCH, _MM_HINT_T0);                    \
            const __m512i w = _mm512_loadu_si512(row + 16 * c);                                    \
            const __m512i lo = _mm512_and_si512(w, low);                                           \
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);                     \
            for (int m = 0; m < RM; m++) {                                                         \
                const int8_t *xc = q->xq + (m0 + m) * q->K + c * CHUNK;                            \
                acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_loadu_si512(xc));                  \
                acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_loadu_si512(xc + CHUNK / 2));      \
            }                                                                                      \
            if (--left)                                                                            \
                continue;                                                                          \
            const float s = q->scales[o * G + g];                                                  \
            for (int m = 0; m < RM; m++) {                                                         \
                const float f = s * q->xs[(m0 + m) * G + g];                                       \
                part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(f), part[m]); \
                acc[m] = _mm512_setzero_si512();                                                   \
            }                                                                                      \
            g++, left = per;                                                                       \
        }                                                                                          \
        for (int m = 0; m < RM; m++)                                                               \
            finish(q, o, m0 + m, _mm512_reduce_add_ps(part[m]));                                   \
    }
ROW_512(1) ROW_512(2) ROW_512(3) ROW_512(4) ROW_512(5) ROW_512(6) ROW_512(7) ROW_512(8)
static void (*const ROWS_512[MAX_RM])(const Q8 *, int64_t, int64_t) = {
    row_512_1, row_512_2, row_512_3, row_512_4, row_512_5, row_512_6, row_512_7, row_512_8};
#endif

/* row o of W against rows [m0, m0 + rows) of x by the path `level` (at most this build's) */
static inline void row(const Q8 *q, int level, int64_t o, int64_t m0, int64_t rows) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (level >= 2) {
        ROWS_512[rows - 1](q, o, m0);
        return;
    }
#endif
#ifdef __AVX2__
    if (level >= 1) {
        ROWS_AVX2[rows - 1](q, o, m0);
        return;
    }
#endif
    (void)level;
    row_plain(q, o, m0, rows);
}

int mmserve_int4_q8_gemv(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group, int level,
                         int threads) {
    if (group % CHUNK || K % group || M < 1)
        return 1;
    const int64_t groups = K / group;
    int8_t *xq = aligned_alloc(64, (size_t)(M * K));
    float *xs = malloc(sizeof(float) * M * groups);
    float *cx = malloc(sizeof(float) * M * groups);
    if (!xq || !xs || !cx) {
        free(xq), free(xs), free(cx);
        return 2;
    }
    quantize(x, M, K, group, xq, xs, cx);
    const Q8 q = {(const uint32_t *)qweight, scales, zeros, xq, xs, cx, bias, y, N, K, group};
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < M; m0 += MAX_RM) {
        const int64_t rows = M - m0 < MAX_RM ? M - m0 : MAX_RM;
#pragma omp for schedule(static) nowait
        for (int64_t o = 0; o < N; o++) /* the same rows of W on a thread in every pass */
            row(&q, level, o, m0, rows);
    }
    free(xq), free(xs), free(cx);
    return 0;
}
