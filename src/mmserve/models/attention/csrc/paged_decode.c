/* Paged decode attention on the CPU, reading K/V where they lie in the block cache.
 *
 * One query token per decoding request attends over that request's cached keys, block by block
 * through its block table, with an online softmax: no gather, no padding, no mask. Work items are
 * (request, part of its context), spread over OpenMP threads (the runtime torch
 * loaded, found by its soname): each request's context in `splits` parts (more than one when the
 * batch has too few requests to keep every thread busy), merged by their log-sum-exps at the end.
 *
 * Layouts (float32, row-major): q, out [T, H, Dh]; k_cache, v_cache [N, S, Hkv, Dh];
 * tables [B, W] int64 (block ids, W the widest table); seq_lens [B] int64 (keys per request,
 * this step's included); rows [B] int64 (each request's row of q and out). Query head i reads
 * key/value head i / (H / Hkv), as torch's enable_gqa does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 1024
#define MAX_BLOCK 1024
/* below any score: no infinities, so the file builds with -ffast-math (vectorised expf) */
#define NO_SCORE -1e30f

/* One part of one request's context, every head: blocks [first, last) of its table, each block
 * read in memory order (token by token, each token's heads side by side). acc[i][d] (query head
 * i) is left unnormalised, with the running max m[i] and sum l[i] of exp(score - m). */
static void attend_part(const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *table, int64_t seq_len, int64_t first, int64_t last,
                        int64_t H, int64_t Hkv, int64_t Dh, int64_t S, float scale,
                        float *acc, float *m, float *l, float *scores /* [H, S] */) {
    const int64_t group = H / Hkv, token_stride = Hkv * Dh;
    const int64_t token_lines = (token_stride * (int64_t)sizeof(float) + 63) / 64;  /* a token's K (or V) rows */
    for (int64_t i = 0; i < H; i++) {
        m[i] = NO_SCORE;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * H * Dh);
    for (int64_t j = first; j < last; j++) {
        const int64_t n = seq_len - j * S < S ? seq_len - j * S : S;
        const float *kb = k_cache + table[j] * S * token_stride;
        const float *vb = v_cache + table[j] * S * token_stride;
        /* the next block lies anywhere in the cache, out of the hardware prefetcher's sight: fetch
         * it a token's rows at a time while this block's are read (the last block fetches itself) */
        const int64_t ahead = table[j + 1 < last ? j + 1 : j] * S * token_stride;
        const char *k_next = (const char *)(k_cache + ahead), *v_next = (const char *)(v_cache + ahead);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t c = 0; c < token_lines; c++) __builtin_prefetch(k_next + (t * token_lines + c) * 64);
            for (int64_t i = 0; i < H; i++) {
                const float *kt = kb + t * token_stride + i / group * Dh, *qi = q + i * Dh;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < Dh; d++) dot += qi[d] * kt[d];
                scores[i * S + t] = dot * scale;
            }
        }
        for (int64_t i = 0; i < H; i++) {
            float *si = scores + i * S, block_max = NO_SCORE;
            for (int64_t t = 0; t < n; t++) block_max = si[t] > block_max ? si[t] : block_max;
            const float m_new = block_max > m[i] ? block_max : m[i];
            const float rescale = expf(m[i] - m_new);  /* 0 on the first block */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                si[t] = expf(si[t] - m_new);
                sum += si[t];
            }
            l[i] = l[i] * rescale + sum;
            m[i] = m_new;
            if (rescale != 1.0f) {
                float *ai = acc + i * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) ai[d] *= rescale;
            }
        }
        for (int64_t t = 0; t < n; t++) {
            for (int64_t c = 0; c < token_lines; c++) __builtin_prefetch(v_next + (t * token_lines + c) * 64);
            for (int64_t i = 0; i < H; i++) {
                const float p = scores[i * S + t], *vt = vb + t * token_stride + i / group * Dh;
                float *ai = acc + i * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) ai[d] += p * vt[d];
            }
        }
    }
}

/* Returns 0, or -1 when a shape is beyond the kernel's limits (the caller then uses another path). */
int mmserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int64_t *tables, const int64_t *seq_lens, const int64_t *rows,
                             float *out, int64_t B, int64_t W, int64_t H, int64_t Hkv, int64_t Dh,
                             int64_t S, float scale, int64_t splits, int threads) {
    if (Dh > MAX_HEAD_DIM || S > MAX_BLOCK || splits < 1 || H % Hkv) return -1;
    const int64_t items = B * splits;
    /* per item: acc [H, Dh], m [H], l [H], scores [H, S] */
    const int64_t per_item = H * (Dh + 2 + S);
    float *work = malloc(sizeof(float) * items * per_item);
    if (!work) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / splits, part = item % splits;
        const int64_t blocks = (seq_lens[b] + S - 1) / S;
        const int64_t per_part = (blocks + splits - 1) / splits;
        const int64_t first = part * per_part < blocks ? part * per_part : blocks;
        const int64_t last = first + per_part < blocks ? first + per_part : blocks;
        float *acc = work + item * per_item, *m = acc + H * Dh, *l = m + H;
        attend_part(q + rows[b] * H * Dh, k_cache, v_cache, tables + b * W, seq_lens[b], first, last,
                    H, Hkv, Dh, S, scale, acc, m, l, l + H);
    }
    /* merge each request's parts and normalise */
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < H; i++) {
            float m_all = NO_SCORE;
            for (int64_t p = 0; p < splits; p++) {
                const float mp = work[(b * splits + p) * per_item + H * Dh + i];
                m_all = mp > m_all ? mp : m_all;
            }
            float *o = out + (rows[b] * H + i) * Dh;
            float total = 0.0f;
            memset(o, 0, sizeof(float) * Dh);
            for (int64_t p = 0; p < splits; p++) {
                const float *acc = work + (b * splits + p) * per_item;
                const float mp = acc[H * Dh + i], lp = acc[H * Dh + H + i];
                if (lp == 0.0f) continue;  /* an empty part */
                const float w = expf(mp - m_all);
                total += lp * w;
                const float *ai = acc + i * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) o[d] += w * ai[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) o[d] *= inv;
        }
    }
    free(work);
    return 0;
}
