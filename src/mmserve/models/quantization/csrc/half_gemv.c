/* A checkpoint's 16-bit weights (float16 or bfloat16) kept as stored on the CPU and multiplied in
 * float32: y [M, N] = x [M, K] W^T, x and y float32, W [N, K] 16-bit row-major (`bf16` 1 for
 * bfloat16). Each weight becomes the float32 it is exactly (F16C's conversion, or bfloat16's 16
 * bits shifted up), so only the order of the sums differs from upcast-then-matmul.
 *
 * Each row of W is read as one stream, decoded once for a pass of up to 4 rows of x, with chains
 * of FMAs per row of x; threads (OpenMP, torch's runtime) split W's rows. Returns 0 when done,
 * nonzero (nothing written) where K is not a multiple of 16.
 */
#include <stdint.h>
#include <string.h>

#define PASS 4 /* rows of x per pass over W */

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define V(op) _mm512_##op
typedef __m512 vec;
#define LOAD_HALVES(p) _mm256_loadu_si256((const __m256i *)(p))
#define AS_FLOATS(bits) _mm512_castsi512_ps(bits)
#define SUM(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define LANES 8
#define V(op) _mm256_##op
typedef __m256 vec;
#define LOAD_HALVES(p) _mm_loadu_si128((const __m128i *)(p))
#define AS_FLOATS(bits) _mm256_castsi256_ps(bits)
static inline float SUM(vec a) {
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, a);
    for (int i = 0; i < 8; i++)
        sum += lanes[i];
    return sum;
}
#endif

#ifdef V
static inline vec load_w(const uint16_t *w, int bf16) {
    return bf16 ? AS_FLOATS(V(slli_epi32)(V(cvtepu16_epi32)(LOAD_HALVES(w)), 16)) : V(cvtph_ps)(LOAD_HALVES(w));
}
#define ZERO() V(setzero_ps)()
#define LOADX(p) V(loadu_ps)(p)
#define FMA(a, b, c) V(fmadd_ps)(a, b, c)
#define ADD(a, b) V(add_ps)(a, b)
#else
#define LANES 1
typedef float vec;
static inline float load_w(const uint16_t *w, int bf16) {
    uint32_t bits;
    if (bf16) {
        bits = (uint32_t)*w << 16;
    } else { /* IEEE half: sign, 5-bit exponent (bias 15), 10-bit mantissa */
        const uint32_t h = *w, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
        if (exp == 0x1f) {
            bits = sign | 0x7f800000u | (man << 13);
        } else if (exp) {
            bits = sign | ((exp + 112) << 23) | (man << 13);
        } else { /* zero or subnormal: man * 2^-24, exact in float32 */
            float f = (float)man * 0x1p-24f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define ZERO() 0.0f
#define LOADX(p) (*(p))
#define FMA(a, b, c) ((a) * (b) + (c))
#define ADD(a, b) ((a) + (b))
#define SUM(a) (a)
#endif

/* row o of W against `rows` rows of x (1 .. PASS), two chains per row of x (inlined with `rows` a
 * constant: the accumulators stay in registers) */
static inline __attribute__((always_inline)) void row_dot(const uint16_t *w, const float *x, float *y, int64_t N, int64_t K, int64_t rows, int bf16,
                    int64_t o) {
    vec acc[PASS][2];
    for (int m = 0; m < PASS; m++)
        acc[m][0] = acc[m][1] = ZERO();
    const uint16_t *row = w + o * K;
    for (int64_t i = 0; i < K; i += 2 * LANES)
        for (int j = 0; j < 2 && i + j * LANES < K; j++) {
            const vec v = load_w(row + i + j * LANES, bf16);
            for (int m = 0; m < PASS; m++)
                if (m < rows)
                    acc[m][j] = FMA(LOADX(x + m * K + i + j * LANES), v, acc[m][j]);
        }
    for (int m = 0; m < rows; m++)
        y[m * N + o] = SUM(ADD(acc[m][0], acc[m][1]));
}

int mmserve_half_gemv(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int bf16,
                      int threads) {
    if (K % 16)
        return 1;
    for (int64_t m0 = 0; m0 < M; m0 += PASS) {
        const int64_t rows = M - m0 < PASS ? M - m0 : PASS;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < N; o++)
            switch (rows) {
#define ROWS(R) case R: row_dot(w, x + m0 * K, y + m0 * N, N, K, R, bf16, o); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
            }
    }
    return 0;
}
