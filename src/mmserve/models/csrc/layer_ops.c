/* The small float32 ops between a decoder layer's GEMMs on the CPU, one call each: RMSNorm (alone
 * or after the residual add), Qwen3's per-head q and k norms together, and the rotary of q and k
 * together (models/layers.py: LayerOps is the PyTorch reference they equal). For decode-sized
 * inputs, where PyTorch's per-op dispatch costs more than the arithmetic: single-threaded, no
 * OpenMP region.
 *
 * Layouts (float32; the last dimension contiguous, the others strided by the given element strides):
 *   rms_norm: x [T, heads, D] (strides sx_t, sx_h), weight [D], out [T, heads, D] contiguous;
 *     with residual [T, D] (stride sr_t; heads is then 1), sum [T, D] contiguous gets residual + x
 *     and the norm is of the sum
 *   qk_norm: q [T, H, D], k [T, Hkv, D] (strides sq_t, sq_h, sk_t, sk_h), each row normed times
 *     q_weight / k_weight [D] into q_out, k_out (contiguous)
 *   rotary: q [T, H, Dh] and k [T, Hkv, Dh] (strides sq_t, sq_h, sk_t, sk_h) rotated by cos, sin
 *     [T, Dh] (row stride sc) into q_out, k_out (contiguous); rotate-half layout:
 *     out[j] = x[j] cos[j] - x[j + Dh/2] sin[j], out[j + Dh/2] = x[j + Dh/2] cos[j + Dh/2] + x[j] sin[j + Dh/2]
 *   silu_mul: gate, up [T, I] (row strides sg, su) -> out [T, I] contiguous, SiLU(gate) * up
 *   width: the float lanes of PyTorch's Vectorized<float> on this machine (its sum's order, and
 *     where its SiLU's vector loop ends)
 * Outputs never overlap inputs. Each product and sum is rounded, and the sum of squares ordered, as
 * PyTorch's op-by-op path does: the results equal it bit for bit (models/cpu_ops.py checks that
 * once per process before using them).
 */
#include <math.h>
#include <stdint.h>

/* every float operation as written: no reassociation, no fused multiply-add, IEEE division and
 * square root (the file is compiled with -ffast-math, mmserve/native.py) */
#if defined(__clang__)
#pragma float_control(precise, on)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif

#define MAX_LANES 16  /* the widest Vectorized<float> (AVX-512) */
#define MAX_D 16384   /* norm widths below it: one thread and one cascade level in PyTorch's sum */

/* PyTorch's float32 sum of a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum,
 * vectorized_inner_sum, row_sum, multi_row_sum), in its order, so that the mean of squares and
 * with it the whole norm equal PyTorch's bit for bit: the row as n items of `lanes` floats
 * (lanes = its Vectorized<float> width when D >= it, else 1), summed lane-wise by four
 * interleaved accumulators, each a cascade of levels of 16 items (one level below 2^20 items:
 * D < MAX_D here); then the accumulators in order, the tail floats, and the lanes in order. */
static float torch_row_sum(const float *x, int64_t D, int64_t width) {
    const int64_t lanes = D >= width ? width : 1, n = D / lanes, rows = n / 4;
    float acc[4][4][MAX_LANES] = {{{0.0f}}};  /* [level][interleaved accumulator][lane] */
    int64_t i = 0;
    for (; i + 16 <= rows;) {
        for (int64_t j = 0; j < 16; ++j, ++i)
            for (int64_t k = 0; k < 4; k++)
                for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l];
        for (int64_t j = 1; j < 4; j++) {
            for (int64_t k = 0; k < 4; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (15 << (j * 4))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l];
    for (int64_t j = 1; j < 4; j++)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    float *part = acc[0][0];  /* row_sum: the leftover items, then the other accumulators */
    for (int64_t r = rows * 4; r < n; r++)
        for (int64_t l = 0; l < lanes; l++) part[l] += x[r * lanes + l];
    for (int64_t k = 1; k < 4; k++)
        for (int64_t l = 0; l < lanes; l++) part[l] += acc[0][k][l];
    if (lanes == 1) return part[0];
    float total = 0.0f;  /* vectorized_inner_sum: the tail floats, then the lanes */
    for (int64_t d = n * lanes; d < D; d++) total += x[d];
    for (int64_t l = 0; l < lanes; l++) total += part[l];
    return total;
}

/* x[0..D) -> out = weight * (x * (1 / sqrt(mean(x^2) + eps))); squares in `squares` [D] */
static void norm_row(const float *x, const float *weight, float *out, float *squares, int64_t D, int64_t width,
                     float eps) {
    for (int64_t d = 0; d < D; d++) squares[d] = x[d] * x[d];
    const float r = 1.0f / sqrtf(torch_row_sum(squares, D, width) / (float)D + eps);
    for (int64_t d = 0; d < D; d++) {
        const float normed = x[d] * r;
        out[d] = weight[d] * normed;
    }
}

/* rows x [T, heads, D] (strides s_t, s_h) normed times weight into out [T, heads, D] */
static void norm_rows(const float *x, int64_t T, int64_t heads, int64_t s_t, int64_t s_h, const float *weight,
                      float *out, int64_t D, int64_t width, float eps, float *squares) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++)
            norm_row(x + t * s_t + h * s_h, weight, out + (t * heads + h) * D, squares, D, width, eps);
}

static int refused(int64_t D, int64_t width) { return D >= MAX_D || width < 1 || width > MAX_LANES; }

int mmserve_rms_norm_f32(const float *x, const float *residual, float *sum, const float *weight, float *out,
                         int64_t T, int64_t heads, int64_t D, int64_t sx_t, int64_t sx_h, int64_t sr_t, float eps,
                         int64_t width) {
    if ((residual != 0 && heads != 1) || refused(D, width)) return 1;
    float squares[MAX_D];
    if (residual == 0) {
        norm_rows(x, T, heads, sx_t, sx_h, weight, out, D, width, eps, squares);
        return 0;
    }
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * sx_t, *r = residual + t * sr_t;
        float *s = sum + t * D;
        for (int64_t d = 0; d < D; d++) s[d] = r[d] + xr[d];
        norm_row(s, weight, out + t * D, squares, D, width, eps);
    }
    return 0;
}

int mmserve_qk_norm_f32(const float *q, const float *k, const float *q_weight, const float *k_weight, float *q_out,
                        float *k_out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t sq_t, int64_t sq_h,
                        int64_t sk_t, int64_t sk_h, float eps, int64_t width) {
    if (refused(D, width)) return 1;
    float squares[MAX_D];
    norm_rows(q, T, H, sq_t, sq_h, q_weight, q_out, D, width, eps, squares);
    norm_rows(k, T, Hkv, sk_t, sk_h, k_weight, k_out, D, width, eps, squares);
    return 0;
}

/* one token's rows x [heads, Dh] (row stride s) rotated by its cos, sin [Dh] into out [heads, Dh] */
static void rotate_heads(const float *x, int64_t heads, int64_t s, const float *cos, const float *sin, float *out,
                         int64_t half) {
    for (int64_t h = 0; h < heads; h++) {
        const float *x1 = x + h * s, *x2 = x1 + half;
        float *o1 = out + h * 2 * half, *o2 = o1 + half;
        for (int64_t j = 0; j < half; j++) {
            const float a = x1[j], b = x2[j];
            const float a_cos = a * cos[j], b_sin = b * sin[j];
            const float b_cos = b * cos[half + j], a_sin = a * sin[half + j];
            o1[j] = a_cos - b_sin;
            o2[j] = b_cos + a_sin;
        }
    }
}

int mmserve_rotary_f32(const float *q, const float *k, const float *cos, const float *sin, float *q_out,
                       float *k_out, int64_t T, int64_t H, int64_t Hkv, int64_t Dh, int64_t sq_t, int64_t sq_h,
                       int64_t sk_t, int64_t sk_h, int64_t sc) {
    if (Dh % 2 != 0) return 1;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * sc, *s = sin + t * sc;
        rotate_heads(q + t * sq_t, H, sq_h, c, s, q_out + t * H * Dh, Dh / 2);
        rotate_heads(k + t * sk_t, Hkv, sk_h, c, s, k_out + t * Hkv * Dh, Dh / 2);
    }
    return 0;
}

/* Sleef's single-precision exp with 1-ulp bound (sleefsimdsp.c: xexpf), which PyTorch's
 * Vectorized<float>::exp calls (Sleef_expf8_u10 / Sleef_expf16_u10), lane by lane: the same
 * reduction by ln 2 in two parts, the same polynomial by fused multiply-adds (Sleef's vmla on
 * x86 with FMA), the same scaling by 2^q in two halves (vldexp2) and the same limits. */
static inline float sleef_expf(float x) {
    /* clamped (a ternary, which vectorizes): the result outside is set at the end */
    const float d = x < -104.0f ? -104.0f : (x > 100.0f ? 100.0f : x);
    const float q = rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf(q, -0.693145751953125f, d);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int32_t e = (int32_t)q, e1 = e >> 1;
    const union { int32_t i; float f; } p1 = {.i = (e1 + 127) * (1 << 23)}, p2 = {.i = (e - e1 + 127) * (1 << 23)};
    u = u * p1.f * p2.f;
    if (x < -104.0f) u = 0.0f;
    if (x > 100.0f) u = INFINITY;
    return u;
}

/* x / (1 + expf(-x)) by the C library's expf, element by element: not vectorized, which would
 * call libmvec's vector expf (another rounding) */
#if defined(__clang__)
static void scalar_silu(const float *g, float *o, int64_t n) {
#pragma clang loop vectorize(disable)
#else
__attribute__((noinline, optimize("no-tree-vectorize"))) static void scalar_silu(const float *g, float *o, int64_t n) {
#endif
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i]));
}

/* SiLU(gate) * up as PyTorch computes F.silu(gate) * up on one thread (Activation.cpp: silu_kernel
 * through cpu_kernel_vec): x / (1 + exp(-x)) with Sleef's exp over each row's vector loop (pairs
 * of `width`-float vectors), the C library's expf over the rest of the row, then the product. */
int mmserve_silu_mul_f32(const float *gate, const float *up, float *out, int64_t T, int64_t I, int64_t sg,
                         int64_t su, int64_t width) {
    if (width < 1 || width > MAX_LANES) return 1;
    const int64_t vector_end = I / (2 * width) * (2 * width);
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate + t * sg, *u = up + t * su;
        float *o = out + t * I;
        for (int64_t i = 0; i < vector_end; i++) o[i] = g[i] / (1.0f + sleef_expf(-g[i]));
        scalar_silu(g + vector_end, o + vector_end, I - vector_end);
        for (int64_t i = 0; i < I; i++) o[i] = o[i] * u[i];
    }
    return 0;
}
