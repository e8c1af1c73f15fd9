/* Pillow's resize of an 8-bit RGB image (libImaging/Resample.c), exactly, in loops the compiler
 * vectorizes: multimodal/resample.py is the caller, Pillow the reference it equals.
 *
 * Pillow resizes by two passes, one per axis, each rounded to uint8. Each output value of a pass is
 *   clamp((2^21 + sum_k w[k] * in[first + k]) >> 22, 0, 255)
 * over int32 weights w (Pillow's own, which the caller reads from Pillow) and the uint8 inputs
 * along that axis; the sums stay below 2^31, as in Pillow. An integer sum has one value in any
 * order, so these loops give Pillow's bytes.
 *
 * Both passes run here as row combinations (`combine`: a weight per input row, whole rows at a time);
 * the horizontal pass is one between two transposes, so no loop gathers.
 *   transpose: src [rows, cols] of `src_elem`-byte pixels -> dst [cols, rows] of `dst_elem`-byte
 *     pixels (3: R, G, B; 4: R, G, B and a zero byte, so that a pixel is one aligned word)
 *   combine: out[o, i] for o < n_out, i < width = the sum above over src rows first[o] + k, k < taps
 *     (src rows of `stride` bytes, w [n_out, taps], out [n_out, width] contiguous); every row read,
 *     first[o] + taps - 1, lies in src (the caller's promise)
 * Single-threaded: P0 processes a request's images on threads of its own.
 */
#include <stdint.h>
#include <string.h>

#define PRECISION_BITS 22 /* Pillow's 32 - 8 - 2 for 8-bit images */
#define CHUNK 4096        /* a row's int32 sums are kept for this many bytes at a time (16 KiB, in L1) */
#define TILE 16           /* transpose tiles of TILE x TILE pixels */

static inline __attribute__((always_inline)) uint32_t load_pixel(const uint8_t *p, int elem)
{
    uint32_t v;
    if (elem == 4)
        memcpy(&v, p, 4);
    else
        v = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
    return v;
}

static inline __attribute__((always_inline)) void store_pixel(uint8_t *p, int elem, uint32_t v)
{
    if (elem == 4) {
        memcpy(p, &v, 4);
    } else {
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
        p[2] = (uint8_t)(v >> 16);
    }
}

static inline __attribute__((always_inline)) void transpose_as(const uint8_t *src, int64_t rows, int64_t cols, int src_elem, int dst_elem,
                                uint8_t *dst)
{
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            int64_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++)
                    store_pixel(dst + (c * rows + r) * dst_elem, dst_elem,
                                load_pixel(src + (r * cols + c) * src_elem, src_elem));
        }
    }
}

int mmserve_transpose(const uint8_t *src, int64_t rows, int64_t cols, int64_t src_elem, int64_t dst_elem,
                      uint8_t *dst)
{
    if (src_elem == 3 && dst_elem == 4)
        transpose_as(src, rows, cols, 3, 4, dst);
    else if (src_elem == 4 && dst_elem == 3)
        transpose_as(src, rows, cols, 4, 3, dst);
    else
        return 1; /* the two the caller uses: RGB into words, words back to RGB */
    return 0;
}

void mmserve_combine(const uint8_t *src, int64_t stride, int64_t width, const int32_t *first, const int32_t *w,
                     int64_t taps, int64_t n_out, uint8_t *out)
{
    int32_t sum[CHUNK];
    for (int64_t o = 0; o < n_out; o++) {
        const int32_t *wo = w + o * taps;
        const uint8_t *rows = src + (int64_t)first[o] * stride;
        uint8_t *row_out = out + o * width;
        for (int64_t i0 = 0; i0 < width; i0 += CHUNK) {
            const int64_t n = width - i0 < CHUNK ? width - i0 : CHUNK;
            for (int64_t i = 0; i < n; i++)
                sum[i] = 1 << (PRECISION_BITS - 1);
            for (int64_t k = 0; k < taps; k++) {
                const int32_t c = wo[k];
                const uint8_t *in = rows + k * stride + i0;
                if (c == 0)
                    continue;
                for (int64_t i = 0; i < n; i++)
                    sum[i] += c * (int32_t)in[i];
            }
            for (int64_t i = 0; i < n; i++) {
                const int32_t v = sum[i] >> PRECISION_BITS;
                row_out[i0 + i] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
            }
        }
    }
}
