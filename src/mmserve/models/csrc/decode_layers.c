/* A decode step's decoder layers in one call on the CPU: the step's C kernels called in the order
 * and with the arguments the Python forward gives them (models/llama.py, models/qwen_text.py
 * through the torch backend's C paths), so the hidden states equal that forward's bit for bit,
 * without the interpreter between the calls (models/cpu_decoder.py builds the plan and calls it).
 *
 * The kernels are the loaded libraries' own functions, reached by the pointers in the plan: the
 * GEMVs (models/quantization/csrc/), the layer ops (layer_ops.c) and the paged decode attention
 * (models/attention/csrc/paged_decode.c). This file adds only the cache write (K/V rows copied to
 * their slots, rounded to a 16-bit cache's dtype to nearest even, as PyTorch's `.to` does) and the
 * bias added after a 16-bit weight's GEMV (as half_gemv's caller adds it).
 *
 * Per layer, T tokens of width D (x, the residual stream carried as in the Python layers):
 *   h, res = norm(x + res)                         (rms_norm alone on the first layer: res = x)
 *   qkv = h Wqkv^T (+ b)                            [T, (H + 2 Hkv) Dh]: q, k, v column ranges
 *   q, k = qk_norm(q, k) (Qwen3), rotary(q, k)       [T, H, Dh], [T, Hkv, Dh] contiguous
 *   cache[slot[t]] = k[t], v[t]; a = attend(q)       [T, H, Dh]
 *   h, res = norm(a Wo^T (+ b) + res)
 *   x = (silu(g) * u) Wdown^T, [g | u] = h Wgu^T     [T, 2I]
 * and at the end out = norm(x + res) by the final norm's weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the cast below rounds as written (the file is compiled with -ffast-math) */
#if defined(__clang__)
#pragma float_control(precise, on)
#else
#pragma GCC optimize("no-fast-math")
#endif

typedef int (*int4_fn)(const float *, const void *, const void *, const void *, const float *, float *, int64_t,
                       int64_t, int64_t, int64_t, int);
typedef int (*int4_q8_fn)(const float *, const void *, const void *, const void *, const float *, float *, int64_t,
                          int64_t, int64_t, int64_t, int, int);
typedef int (*fp8_fn)(const float *, const void *, const void *, const float *, float *, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int);
typedef int (*half_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t, int, int);
typedef int (*norm_fn)(const float *, const float *, float *, const float *, float *, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, float, int64_t);
typedef int (*qk_norm_fn)(const float *, const float *, const float *, const float *, float *, float *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t);
typedef int (*rotary_fn)(const float *, const float *, const float *, const float *, float *, float *, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*silu_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*attend_fn)(const float *, const void *, const void *, const int64_t *, const int64_t *,
                         const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         int64_t, int);

enum { INT4 = 1, INT4_Q8 = 2, FP8 = 3, HALF = 4, INT8 = 5, W8A8 = 6 }; /* mm_linear.kind: which kernel's signature */
enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2 }; /* mm_decoder.cache_dtype */

/* One linear layer's GEMV: y [T, N] = x [T, K] W^T (+ bias). `fallback` (or NULL) is called when
 * `fn` refuses (a narrower build of the same product, as cpu_gemv.py tries them); `flag` is the
 * int8 kernel's level or, for a 16-bit weight, 1 for bfloat16. */
typedef struct {
    int64_t kind;
    void *fn, *fallback;
    const void *weight, *scales, *zeros;
    const float *bias;
    int64_t N, K, group, block_out, block_in, flag;
} mm_linear;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm NULL: none (Llama, Qwen2) */
    mm_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [blocks, S, Hkv, Dh] each */
} mm_layer;

typedef struct {
    int64_t layers, D, H, Hkv, Dh, I, S, cache_dtype, lanes, silu_lanes;
    float eps, scale;
    norm_fn rms_norm;
    qk_norm_fn qk_norm;
    rotary_fn rotary;
    silu_fn silu_mul;
    attend_fn attend;
    const float *final_norm;
    const mm_layer *layer;
} mm_decoder;

static int call_fn(const mm_linear *l, void *fn, const float *x, float *y, int64_t T, int threads) {
    switch (l->kind) {
    case INT4:
    case INT8: /* the int8 GEMV takes int4's arguments (codes, scales, int16 zeros) */
    case W8A8: /* so does W8A8's (codes, row scales then the input scale, row sums; `group`: static) */
        return ((int4_fn)fn)(x, l->weight, l->scales, l->zeros, l->bias, y, T, l->N, l->K, l->group, threads);
    case INT4_Q8:
        return ((int4_q8_fn)fn)(x, l->weight, l->scales, l->zeros, l->bias, y, T, l->N, l->K, l->group,
                                (int)l->flag, threads);
    case FP8:
        return ((fp8_fn)fn)(x, l->weight, l->scales, l->bias, y, T, l->N, l->K, l->block_out, l->block_in, threads);
    case HALF: {
        if (((half_fn)fn)(x, l->weight, y, T, l->N, l->K, (int)l->flag, threads)) return 1;
        if (l->bias)  /* added after the product, as half_gemv's caller does */
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = 0; n < l->N; n++) y[t * l->N + n] = y[t * l->N + n] + l->bias[n];
        return 0;
    }
    }
    return 1;
}

static int linear(const mm_linear *l, const float *x, float *y, int64_t T, int threads) {
    if (call_fn(l, l->fn, x, y, T, threads) == 0) return 0;
    return l->fallback == NULL || call_fn(l, l->fallback, x, y, T, threads);
}

/* float32 -> IEEE half, to nearest even (FP16's fp16_ieee_from_fp32_value, which c10::Half uses) */
static uint16_t to_f16(float f) {
    union { float f; uint32_t u; } in = {.f = f}, base;
    const uint32_t w = in.u, shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    union { uint32_t u; float f; } b = {.u = (bias >> 1) + 0x07800000u};
    const float scaled = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    base.f = b.f + scaled;
    const uint32_t nonsign = ((base.u >> 13) & 0x00007C00u) + (base.u & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16, to nearest even (c10::BFloat16's round_to_nearest_even; NaN a quiet NaN) */
static uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } in = {.f = f};
    if (f != f) return 0x7FC0;
    return (uint16_t)((in.u + ((in.u >> 16) & 1u) + 0x7FFFu) >> 16);
}

/* rows x [T, width] (row stride sx) to rows slots[t] of cache [*, width] in its dtype */
static void write_cache(void *cache, int64_t dtype, const int64_t *slots, const float *x, int64_t T, int64_t width,
                        int64_t sx) {
    for (int64_t t = 0; t < T; t++) {
        const float *row = x + t * sx;
        if (dtype == CACHE_F32) {
            memcpy((float *)cache + slots[t] * width, row, (size_t)width * sizeof(float));
            continue;
        }
        uint16_t *out = (uint16_t *)cache + slots[t] * width;
        for (int64_t d = 0; d < width; d++) out[d] = dtype == CACHE_F16 ? to_f16(row[d]) : to_bf16(row[d]);
    }
}

/* one step's inputs besides the hidden states */
typedef struct {
    const float *cos, *sin;  /* [T, Dh] each, rows `rope_stride` apart */
    int64_t rope_stride;
    const int64_t *slots;    /* [T]: each token's cache slot */
    const int64_t *tables;   /* [T, W]: each request's block table, padded */
    int64_t W;
    const int64_t *lens;     /* [T]: each request's keys, this token's included */
    const int64_t *rows;     /* [T]: each request's row of q (0 .. T-1) */
    int64_t splits;          /* the attention kernel's parts per context */
} mm_step;

/* scratch rows of one step */
typedef struct {
    float *res[2], *h, *x, *qkv, *qn, *kn, *qr, *kr, *attn, *gu, *act;
} mm_scratch;

static float *carve(float **next, int64_t floats) {
    float *p = *next;
    *next += (floats + 15) / 16 * 16;  /* 64-byte aligned, as PyTorch's allocations are */
    return p;
}

static float *scratch(const mm_decoder *m, int64_t T, mm_scratch *s) {
    const int64_t D = m->D, Q = m->H * m->Dh, KV = m->Hkv * m->Dh;
    const int64_t sizes[] = {D, D, D, D, Q + 2 * KV, Q, KV, Q, KV, Q, 2 * m->I, m->I};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) total += (T * sizes[i] + 15) / 16 * 16;
    float *base = aligned_alloc(64, (size_t)total * sizeof(float)), *next = base;
    if (base == NULL) return NULL;
    float **slots[] = {&s->res[0], &s->res[1], &s->h, &s->x, &s->qkv, &s->qn, &s->kn, &s->qr, &s->kr, &s->attn,
                       &s->gu, &s->act};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) *slots[i] = carve(&next, T * sizes[i]);
    return base;
}

/* q, k rotated (after Qwen3's norms) into s->qr, s->kr; K/V written; the attention into s->attn */
static int attention(const mm_decoder *m, const mm_layer *L, const mm_step *st, mm_scratch *s, int64_t T,
                     int threads) {
    const int64_t H = m->H, Hkv = m->Hkv, Dh = m->Dh, E = (H + 2 * Hkv) * Dh;
    const float *q = s->qkv, *k = s->qkv + H * Dh, *v = s->qkv + (H + Hkv) * Dh;
    int64_t sq = E, sk = E;
    if (L->q_norm != NULL) {
        if (m->qk_norm(q, k, L->q_norm, L->k_norm, s->qn, s->kn, T, H, Hkv, Dh, E, Dh, E, Dh, m->eps, m->lanes))
            return 1;
        q = s->qn, k = s->kn, sq = H * Dh, sk = Hkv * Dh;
    }
    if (m->rotary(q, k, st->cos, st->sin, s->qr, s->kr, T, H, Hkv, Dh, sq, Dh, sk, Dh, st->rope_stride)) return 1;
    write_cache(L->k_cache, m->cache_dtype, st->slots, s->kr, T, Hkv * Dh, Hkv * Dh);
    write_cache(L->v_cache, m->cache_dtype, st->slots, v, T, Hkv * Dh, E);
    return m->attend(s->qr, L->k_cache, L->v_cache, st->tables, st->lens, st->rows, s->attn, T, st->W, H, Hkv, Dh,
                     m->S, m->scale, st->splits, threads);
}

/* one layer; *res is the residual stream (NULL before the first layer, whose input x is all of it) */
static int layer(const mm_decoder *m, const mm_layer *L, const mm_step *st, mm_scratch *s, const float **x,
                 const float **res, int *flip, int64_t T, int threads) {
    const int64_t D = m->D;
    float *total = s->res[*flip ^= 1];
    if (*res == NULL) {
        if (m->rms_norm(*x, NULL, NULL, L->input_norm, s->h, T, 1, D, D, 0, 0, m->eps, m->lanes)) return 1;
        *res = *x;
    } else {
        if (m->rms_norm(*x, *res, total, L->input_norm, s->h, T, 1, D, D, 0, D, m->eps, m->lanes)) return 1;
        *res = total;
    }
    if (linear(&L->qkv, s->h, s->qkv, T, threads) || attention(m, L, st, s, T, threads)) return 1;
    float *o = s->x;
    if (linear(&L->o, s->attn, o, T, threads)) return 1;
    total = s->res[*flip ^= 1];
    if (m->rms_norm(o, *res, total, L->post_norm, s->h, T, 1, D, D, 0, D, m->eps, m->lanes)) return 1;
    *res = total;
    if (linear(&L->gate_up, s->h, s->gu, T, threads)) return 1;
    if (m->silu_mul(s->gu, s->gu + m->I, s->act, T, m->I, 2 * m->I, 2 * m->I, m->silu_lanes)) return 1;
    if (linear(&L->down, s->act, s->x, T, threads)) return 1;
    *x = s->x;
    return 0;
}

/* sizeof of the plan's structs (0: mm_linear, 1: mm_layer, 2: mm_decoder, 3: mm_step), which
 * models/cpu_decoder.py checks its ctypes mirrors against before using the library */
int64_t mmserve_decode_struct_size(int which) {
    const int64_t sizes[] = {sizeof(mm_linear), sizeof(mm_layer), sizeof(mm_decoder), sizeof(mm_step)};
    return which >= 0 && which < 4 ? sizes[which] : -1;
}

/* The decoder over one decode step: embeds [T, D] (read only) -> out [T, D], the final norm's
 * output. Returns 0, or 1 when a kernel refused its arguments (the caller then runs the step in
 * Python: the cache slots written meanwhile get the same values again) or memory ran out. */
int mmserve_decode_layers(const mm_decoder *m, const float *embeds, float *out, int64_t T, const mm_step *st,
                          int threads) {
    mm_scratch s;
    float *base = scratch(m, T, &s);
    if (base == NULL) return 1;
    const float *x = embeds, *res = NULL;
    int flip = 1, failed = 0;
    for (int64_t l = 0; l < m->layers && !failed; l++)
        failed = layer(m, &m->layer[l], st, &s, &x, &res, &flip, T, threads);
    if (!failed)
        failed = m->rms_norm(x, res, s.res[flip ^ 1], m->final_norm, out, T, 1, m->D, m->D, 0, m->D, m->eps,
                             m->lanes);
    free(base);
    return failed;
}
