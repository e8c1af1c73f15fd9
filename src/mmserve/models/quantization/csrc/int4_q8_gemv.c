/* Int4 weights times int8-quantized activations: the opt-in GEMV of `--cpu-activation-quant int8`
 * (models/quantization/q8_gemv.py). Not exact: x is rounded to int8.
 *
 * y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32, W an int4 weight of models/quantization/
 * int4.py (code of column 8j + k of row o in nibble k of word j, 0..15; a scale and a zero code per
 * group of columns; W[o, i] = (code - zero) * scale) held with its rows interleaved by 16
 * (q8_gemv.py: `interleave`): qweight int32 [N / 16, K / 8, 16] (word j of rows 16b .. 16b + 15
 * side by side), scales float32 and zeros uint8 [N / 16, G, 16], G = K / group. One vector lane is
 * one row of W, so a group's integers land in a row's lane and the float work of a group is one
 * conversion and one FMA for 16 rows.
 *
 * Each row of x is quantized per block of the weight's group (`quantize`): xs = max|x| * (1/127)
 * (the float32 constant), code = round-half-even(x * (127 / max|x|)) in -127..127 (all zeros for
 * a block of zeros), and the block's sum of codes kept (as xs * sum_x, `cx`). Then per row o of W:
 *   dot[g] = sum_i code_w[o, i] * code_x[i] over group g's columns (exact, in int32),
 *   y[m, o] = bias[o] + sum_g scales[o, g] * xs[m, g] * dot[g] - sum_g scales[o, g] * zeros[o, g] * cx[m, g]
 * in float32: scales * xs * (dot - zero * sum_x) up to float rounding.
 * The integers are the same on every path: AVX-512 VNNI (`vpdpbusd`: u8 weight codes x s8
 * activation codes, four products per int32 lane), AVX2 (`vpmaddubsw` into int16 pairs, at most
 * 2 * 15 * 127 each and twice that summed, then `vpmaddwd` by ones) and plain C; only the order of
 * the float sums differs.
 *
 * The codes of x are laid out per 128-column chunk as its even columns then its odd ones
 * (xq[128c + i / 2 + 64 (i % 2)] = code of column 128c + i), so that a word's low nibbles
 * (word & 0x0F0F0F0F: columns 8j + 2b in byte b) meet 4 consecutive bytes of the even half, and its
 * high nibbles (columns 8j + 2b + 1) the odd half's: each broadcast to every lane. Hence group %
 * 128 == 0 and N % 16 == 0 (the caller keeps the exact kernels otherwise).
 * Threads (OpenMP, torch's runtime) split W's blocks of 16 rows; each pass takes up to MAX_RM rows
 * of x and reads W once for all of them, its stream prefetched far ahead (the hardware's
 * prefetcher alone left a pass at ~half a read's bandwidth). Returns 0 when done, nonzero
 * (nothing written) otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RM 8   /* rows of x per pass over W */
#define CHUNK 128  /* columns per layout chunk of x: 64 bytes of even columns' codes, 64 of odd */
#define LANES 16   /* rows of W interleaved */
#define PREFETCH 16384 /* bytes ahead in W's stream a step prefetches (8-64 KiB alike, 1-4 gained little) */

typedef struct {
    const uint32_t *qweight; /* [N / 16, K / 8, 16] */
    const float *scales;     /* [N / 16, G, 16] */
    const uint8_t *zeros;    /* [N / 16, G, 16] */
    const int8_t *xq;        /* [M, K] codes of x in the chunk layout */
    const float *xs;         /* [M, G] scale of each block of x */
    const float *cx;         /* [M, G] xs * (the block's sum of codes): the zero points' factor */
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

/* the 4 codes of x word j's low (odd = 0) or high (odd = 1) nibbles meet, as one int32 */
static inline int32_t x_codes(const int8_t *xm, int64_t j, int odd) {
    int32_t v;
    memcpy(&v, xm + (j / 16) * CHUNK + odd * (CHUNK / 2) + 4 * (j % 16), 4);
    return v;
}

/* word j of one row against its 8 x codes: exact */
static inline int32_t word_dot(uint32_t word, const int8_t *xm, int64_t j) {
    const int8_t *even = xm + (j / 16) * CHUNK + 4 * (j % 16), *odd = even + CHUNK / 2;
    int32_t s = 0;
    for (int b = 0; b < 4; b++)
        s += (int32_t)((word >> (8 * b)) & 15) * even[b] + (int32_t)((word >> (8 * b + 4)) & 15) * odd[b];
    return s;
}

/* Block b (rows 16b ..) of W against `rows` rows of x from m0, plain C */
static void block_plain(const Q8 *q, int64_t b, int64_t m0, int64_t rows) {
    const int64_t G = q->K / q->group, words = q->K / 8;
    for (int64_t m = m0; m < m0 + rows; m++)
        for (int r = 0; r < LANES; r++) {
            float part = 0.0f, zero = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t dot = 0;
                for (int64_t j = g * q->group / 8; j < (g + 1) * q->group / 8; j++)
                    dot += word_dot(q->qweight[(b * words + j) * LANES + r], q->xq + m * q->K, j);
                const int64_t at = (b * G + g) * LANES + r;
                part += q->scales[at] * q->xs[m * G + g] * (float)dot;
                zero += q->scales[at] * (float)q->zeros[at] * q->cx[m * G + g];
            }
            const int64_t o = LANES * b + r;
            q->y[m * q->N + o] = (q->bias ? q->bias[o] : 0.0f) + part - zero;
        }
}

#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>
#endif

#ifdef __AVX2__
/* Block b of W against RM rows of x from m0, AVX2: each half of the block (8 rows) in turn; per
 * word, the low and high nibbles' maddubs against the broadcast x codes summed in int16, then to
 * int32 by madd with ones; per group, the lanes as floats times scale * xs */
#define BLOCK_AVX2(RM)                                                                             \
    static void block_avx2_##RM(const Q8 *q, int64_t b, int64_t m0) {                              \
        const int64_t G = q->K / q->group, words = q->K / 8;                                       \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                     \
        for (int h = 0; h < 2; h++) {                                                              \
            const uint32_t *w0 = q->qweight + b * words * LANES + 8 * h;                           \
            __m256 part[RM], zero[RM];                                                             \
            for (int m = 0; m < RM; m++)                                                           \
                part[m] = zero[m] = _mm256_setzero_ps();                                           \
            for (int64_t g = 0; g < G; g++) {                                                      \
                __m256i acc[RM];                                                                   \
                for (int m = 0; m < RM; m++)                                                       \
                    acc[m] = _mm256_setzero_si256();                                               \
                for (int64_t j = g * q->group / 8; j < (g + 1) * q->group / 8; j++) {              \
                    _mm_prefetch((const char *)(w0 + j * LANES) + PREFETCH, _MM_HINT_T0);          \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(w0 + j * LANES));       \
                    const __m256i lo = _mm256_and_si256(w, low);                                   \
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(w, 4), low);             \
                    for (int m = 0; m < RM; m++) {                                                 \
                        const int8_t *xm = q->xq + (m0 + m) * q->K;                                \
                        const __m256i e = _mm256_set1_epi32(x_codes(xm, j, 0));                    \
                        const __m256i d = _mm256_set1_epi32(x_codes(xm, j, 1));                    \
                        const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, d)); \
                        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(s, ones));             \
                    }                                                                              \
                }                                                                                  \
                const int64_t at = (b * G + g) * LANES + 8 * h;                                    \
                const __m256 s = _mm256_loadu_ps(q->scales + at);                                  \
                const __m256 sz = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(        \
                    _mm_loadl_epi64((const __m128i *)(q->zeros + at)))));                          \
                for (int m = 0; m < RM; m++) {                                                     \
                    const __m256 f = _mm256_mul_ps(s, _mm256_set1_ps(q->xs[(m0 + m) * G + g]));    \
                    part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), f, part[m]);             \
                    zero[m] = _mm256_fmadd_ps(sz, _mm256_set1_ps(q->cx[(m0 + m) * G + g]), zero[m]); \
                }                                                                                  \
            }                                                                                      \
            const int64_t o = LANES * b + 8 * h;                                                   \
            const __m256 bias = q->bias ? _mm256_loadu_ps(q->bias + o) : _mm256_setzero_ps();      \
            for (int m = 0; m < RM; m++)                                                           \
                _mm256_storeu_ps(q->y + (m0 + m) * q->N + o, _mm256_add_ps(bias, _mm256_sub_ps(part[m], zero[m]))); \
        }                                                                                          \
    }
BLOCK_AVX2(1) BLOCK_AVX2(2) BLOCK_AVX2(3) BLOCK_AVX2(4) BLOCK_AVX2(5) BLOCK_AVX2(6) BLOCK_AVX2(7) BLOCK_AVX2(8)
static void (*const BLOCKS_AVX2[MAX_RM])(const Q8 *, int64_t, int64_t) = {
    block_avx2_1, block_avx2_2, block_avx2_3, block_avx2_4, block_avx2_5, block_avx2_6, block_avx2_7, block_avx2_8};
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Block b of W against RM rows of x from m0, AVX-512 VNNI: per word, two vpdpbusd per row of x (low
 * nibbles x the broadcast even codes, high x odd) into the group's int32 lanes; per group, the
 * lanes as floats times scale * xs, and the zero points' term */
#define BLOCK_512(RM)                                                                              \
    static void block_512_##RM(const Q8 *q, int64_t b, int64_t m0) {                               \
        const int64_t G = q->K / q->group, words = q->K / 8;                                       \
        const uint32_t *w0 = q->qweight + b * words * LANES;                                       \
        const __m512i low = _mm512_set1_epi8(15);                                                  \
        __m512 part[RM], zero[RM];                                                                 \
        for (int m = 0; m < RM; m++)                                                               \
            part[m] = zero[m] = _mm512_setzero_ps();                                               \
        for (int64_t g = 0; g < G; g++) {                                                          \
            __m512i acc[RM];                                                                       \
            for (int m = 0; m < RM; m++)                                                           \
                acc[m] = _mm512_setzero_si512();                                                   \
            for (int64_t j = g * q->group / 8; j < (g + 1) * q->group / 8; j++) {                  \
                _mm_prefetch((const char *)(w0 + j * LANES) + PREFETCH, _MM_HINT_T0);              \
                const __m512i w = _mm512_loadu_si512(w0 + j * LANES);                              \
                const __m512i lo = _mm512_and_si512(w, low);                                       \
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);                 \
                for (int m = 0; m < RM; m++) {                                                     \
                    const int8_t *xm = q->xq + (m0 + m) * q->K;                                    \
                    acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(x_codes(xm, j, 0))); \
                    acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_set1_epi32(x_codes(xm, j, 1))); \
                }                                                                                  \
            }                                                                                      \
            const int64_t at = (b * G + g) * LANES;                                                \
            const __m512 s = _mm512_loadu_ps(q->scales + at);                                      \
            const __m512 sz = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(           \
                _mm_loadu_si128((const __m128i *)(q->zeros + at)))));                              \
            for (int m = 0; m < RM; m++) {                                                         \
                const __m512 f = _mm512_mul_ps(s, _mm512_set1_ps(q->xs[(m0 + m) * G + g]));        \
                part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), f, part[m]);                 \
                zero[m] = _mm512_fmadd_ps(sz, _mm512_set1_ps(q->cx[(m0 + m) * G + g]), zero[m]);   \
            }                                                                                      \
        }                                                                                          \
        const __m512 bias = q->bias ? _mm512_loadu_ps(q->bias + LANES * b) : _mm512_setzero_ps();  \
        for (int m = 0; m < RM; m++)                                                               \
            _mm512_storeu_ps(q->y + (m0 + m) * q->N + LANES * b, _mm512_add_ps(bias, _mm512_sub_ps(part[m], zero[m]))); \
    }
BLOCK_512(1) BLOCK_512(2) BLOCK_512(3) BLOCK_512(4) BLOCK_512(5) BLOCK_512(6) BLOCK_512(7) BLOCK_512(8)
static void (*const BLOCKS_512[MAX_RM])(const Q8 *, int64_t, int64_t) = {
    block_512_1, block_512_2, block_512_3, block_512_4, block_512_5, block_512_6, block_512_7, block_512_8};
#endif

/* block b of W against rows [m0, m0 + rows) of x by the path `level` (at most this build's) */
static inline void block(const Q8 *q, int level, int64_t b, int64_t m0, int64_t rows) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (level >= 2) {
        BLOCKS_512[rows - 1](q, b, m0);
        return;
    }
#endif
#ifdef __AVX2__
    if (level >= 1) {
        BLOCKS_AVX2[rows - 1](q, b, m0);
        return;
    }
#endif
    (void)level;
    block_plain(q, b, m0, rows);
}

int mmserve_int4_q8_gemv(const float *x, const int32_t *qweight, const float *scales, const uint8_t *zeros,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t group, int level,
                         int threads) {
    if (group % CHUNK || K % group || N % LANES || M < 1)
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
        for (int64_t b = 0; b < N / LANES; b++) /* the same blocks of W on a thread in every pass */
            block(&q, level, b, m0, rows);
    }
    free(xq), free(xs), free(cx);
    return 0;
}
