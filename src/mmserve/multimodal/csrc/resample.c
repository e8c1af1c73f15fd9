/* Pillow's two-pass convolution resize of an 8-bit image (libImaging/Resample.c), exactly, in
 * vectorizable loops: multimodal/fast_resize.py is the caller, PIL the reference it equals.
 *
 * Pillow resizes horizontally, rounds to uint8, then vertically. Each output value is
 *   clamp((2^21 + sum_k w[k] * in[first + k]) >> 22, 0, 255)
 * over int32 weights w (Pillow's own: the caller reads them from Pillow) and uint8 inputs; the sums
 * stay below 2^31 as in Pillow. An integer sum has one value in any order, so these loops give
 * Pillow's bytes.
 *
 * Both passes run here as row combinations (one weight per input row, a whole row at a time, which
 * the compiler vectorizes); the horizontal pass is one on the transposed image:
 *   transpose: src [rows, cols, elem] -> dst [cols, rows, elem] (uint8, contiguous)
 *   combine: out[o, i] for o < n_out, i < width = the sum above over src rows first[o] + k,
 *     k < taps (src [*, width] with row stride `stride`, w [n_out, taps], out [n_out, width]).
 * Single-threaded: P0 processes a request's images on its own threads.
 */
#include <stdint.h>
#include <string.h>

#define PRECISION_BITS 22 /* Pillow's (32 - 8 - 2) for 8-bit images */
#define CHUNK 2048        /* the int32 sums of one chunk of a row stay in L1 */
#define TILE 32

void mmserve_transpose(const uint8_t *src, int64_t rows, int64_t cols, int64_t elem, uint8_t *dst)
{
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            int64_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++)
                    memcpy(dst + (c * rows + r) * elem, src + (r * cols + c) * elem, (size_t)elem);
        }
    }
}

void mmserve_combine(const uint8_t *src, int64_t stride, int64_t width, const int32_t *first,
                     const int32_t *w, int64_t taps, int64_t n_out, uint8_t *out)
{
    int32_t sum[CHUNK];
    for (int64_t o = 0; o < n_out; o++) {
        const int32_t *wo = w + o * taps;
        const uint8_t *base = src + (int64_t)first[o] * stride;
        uint8_t *row = out + o * width;
        for (int64_t i0 = 0; i0 < width; i0 += CHUNK) {
            int64_t n = width - i0 < CHUNK ? width - i0 : CHUNK;
            for (int64_t i = 0; i < n; i++)
                sum[i] = 1 << (PRECISION_BITS - 1);
            for (int64_t k = 0; k < taps; k++) {
                const int32_t c = wo[k];
                const uint8_t *in = base + k * stride + i0;
                if (c == 0)
                    continue;
                for (int64_t i = 0; i < n; i++)
                    sum[i] += c * (int32_t)in[i];
            }
            for (int64_t i = 0; i < n; i++) {
                int32_t v = sum[i] >> PRECISION_BITS;
                row[i0 + i] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
            }
        }
    }
}
