/* W8A8's decode GEMV on the CPU (models/quantization/w8a8.py): a step's rows of x quantized to int8
 * and multiplied by the int8 weight in integers, then scaled; the same numbers, bit for bit, as
 * w8a8.py's torch path (`quantize_rows`, then `torch._int_mm` scaled), which the tests hold it to.
 *
 * y [M, N] = x [M, K] W^T (+ bias [N]), x and y float32; W int8 [N, K] with a float32 scale per row
 * (`scales` [N + 1]: the rows', then the static input scale where `static_input`) and the sum of
 * each row's codes (`wsum` int32 [N], made at load). Each row m of x is quantized as w8a8.py's
 * `quantize_rows` defines it: dynamic, inv = 127 / max|x_m| and s_m = max|x_m| / 127 (IEEE
 * divisions; a row of zeros: codes 0, s_m = 0), code = x * inv rounded half to even; static, code =
 * x / s rounded half to even, s_m = s; either clamped to [-128, 127]. Then
 *   dot = sum_k code_x[m, k] code_w[o, k]   (exact, int32),
 *   y[m, o] = ((float)dot * s_m) * scales[o] (+ bias[o])   in that order, as torch computes it.
 * The file is compiled without -ffast-math (MMSERVE_NO_FAST_MATH: mmserve/native.py): the
 * divisions and the order of the products above must be IEEE's, not reassociated.
 *
 * The integers are the same on every path: AVX-512 VNNI (`vpdpbusd` takes an unsigned operand, so
 * x's codes go in offset by 128 and 128 * wsum[o] comes off the sum), AVX2 (codes widened to int16,
 * `vpmaddwd` into int32: no int16 saturation, whatever the codes) and plain C; `level` picks the
 * widest of them up to it that this build has (2, 1, 0). Threads (OpenMP,
 * torch's runtime) split W's rows; each pass over W takes up to MAX_RM rows of x. Returns 0 when
 * done, nonzero (nothing written) otherwise.
 */
#define MMSERVE_NO_FAST_MATH
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>
#endif

#define MAX_RM 8 /* rows of x per pass over W */

/* Row x [K] into codes and its scale (see the top of the file); `fixed`: the static scale, or 0 */
static float quantize_row(const float *x, int64_t K, float fixed, int8_t *q) {
    float inv = 0.0f, s = fixed;
    if (fixed == 0.0f) {
        float peak = 0.0f;
        for (int64_t k = 0; k < K; k++)
            peak = fmaxf(peak, fabsf(x[k]));
        inv = peak > 0.0f ? 127.0f / peak : 0.0f;
        s = peak / 127.0f;
    }
    for (int64_t k = 0; k < K; k++) {
        float v = nearbyintf(fixed == 0.0f ? x[k] * inv : x[k] / fixed);
        q[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v));
    }
    return s;
}

static int32_t dot_plain(const int8_t *a, const int8_t *w, int64_t K) {
    int32_t s = 0;
    for (int64_t k = 0; k < K; k++)
        s += (int32_t)a[k] * (int32_t)w[k];
    return s;
}

#ifdef __AVX2__
static inline int32_t hsum256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* row w of W against `rows` rows of codes (16 columns at a time, widened to int16); K % 16 == 0 */
static void dots_avx2(const int8_t *xq, const int8_t *w, int64_t K, int64_t rows, int32_t *out) {
    __m256i acc[MAX_RM];
    for (int64_t m = 0; m < rows; m++)
        acc[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i wk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
        for (int64_t m = 0; m < rows; m++) {
            const __m256i xk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + m * K + k)));
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(xk, wk));
        }
    }
    for (int64_t m = 0; m < rows; m++)
        out[m] = hsum256(acc[m]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* row w of W against `rows` rows of codes offset by 128 (u8), 64 columns at a time; K % 64 == 0.
 * Each sum is dot + 128 * wsum: the caller takes the offset off. */
static void dots_512(const uint8_t *xu, const int8_t *w, int64_t K, int64_t rows, int32_t *out) {
    __m512i acc[MAX_RM];
    for (int64_t m = 0; m < rows; m++)
        acc[m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        _mm_prefetch((const char *)(w + k) + 4096, _MM_HINT_T0);
        const __m512i wk = _mm512_loadu_si512(w + k);
        for (int64_t m = 0; m < rows; m++)
            acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu + m * K + k), wk);
    }
    for (int64_t m = 0; m < rows; m++)
        out[m] = _mm512_reduce_add_epi32(acc[m]);
}
#endif

/* y's rows [m0, m0 + rows) at output o from their exact dots */
static inline void scale_out(const int32_t *dot, const float *xs, const float *scales, const float *bias, float *y,
                             int64_t m0, int64_t rows, int64_t N, int64_t o) {
    for (int64_t m = 0; m < rows; m++) {
        float v = (float)dot[m] * xs[m0 + m];
        v = v * scales[o];
        y[(m0 + m) * N + o] = bias ? v + bias[o] : v;
    }
}

int mmserve_w8a8_gemv_level(const float *x, const int8_t *w, const float *scales, const int32_t *wsum,
                            const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t static_input,
                            int level, int threads) {
    if (M < 1 || N < 1 || K < 1)
        return 1;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *xs = malloc(sizeof(float) * (size_t)M);
    if (!xq || !xs) {
        free(xq), free(xs);
        return 2;
    }
    const float fixed = static_input ? scales[N] : 0.0f;
    for (int64_t m = 0; m < M; m++)
        xs[m] = quantize_row(x + m * K, K, fixed, xq + m * K);
    if (level >= 2 && K % 64)
        level = 1;
    if (level >= 1 && K % 16)
        level = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (level >= 2)
        for (int64_t i = 0; i < M * K; i++) /* x + 128 as u8: what vpdpbusd multiplies */
            xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80);
#endif
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < M; m0 += MAX_RM) {
        const int64_t rows = M - m0 < MAX_RM ? M - m0 : MAX_RM;
        int32_t dot[MAX_RM];
#pragma omp for schedule(static) nowait
        for (int64_t o = 0; o < N; o++) {
            const int8_t *row = w + o * K;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if (level >= 2) {
                dots_512((const uint8_t *)xq + m0 * K, row, K, rows, dot);
                for (int64_t m = 0; m < rows; m++)
                    dot[m] -= 128 * wsum[o];
                scale_out(dot, xs, scales, bias, y, m0, rows, N, o);
                continue;
            }
#endif
#ifdef __AVX2__
            if (level >= 1) {
                dots_avx2(xq + m0 * K, row, K, rows, dot);
                scale_out(dot, xs, scales, bias, y, m0, rows, N, o);
                continue;
            }
#endif
            for (int64_t m = 0; m < rows; m++)
                dot[m] = dot_plain(xq + (m0 + m) * K, row, K);
            scale_out(dot, xs, scales, bias, y, m0, rows, N, o);
        }
    }
    free(xq), free(xs);
    return 0;
}

/* The compiled decode step's signature (int4's: models/csrc/decode_layers.c, kind W8A8): `group`
 * carries `static_input`; the widest path this build has (a level past it takes the widest below). */
int mmserve_w8a8_gemv(const float *x, const int8_t *w, const float *scales, const int32_t *wsum, const float *bias,
                      float *y, int64_t M, int64_t N, int64_t K, int64_t static_input, int threads) {
    return mmserve_w8a8_gemv_level(x, w, scales, wsum, bias, y, M, N, K, static_input, 2, threads);
}
