/* PNG's row filters undone (the PNG specification, 9 "Filtering"), for 8-bit samples: the step of
 * decoding a PNG between inflating its image data and its pixels; multimodal/png.py is the caller,
 * Pillow's decoder the reference it equals.
 *
 *   raw: `rows` rows of 1 + row_bytes bytes, each a filter type (0 None, 1 Sub, 2 Up, 3 Average,
 *     4 Paeth) and the filtered bytes; bpp: bytes per pixel (the left neighbour's distance)
 *   out: rows x row_bytes, the reconstructed bytes (raw and out do not overlap)
 * Returns 0; 1 at the first row whose filter type is not one of the five (out is then partial); 2
 * without memory.
 *
 * Sub, Average and Paeth chain each byte to the one bpp before it. With 3 or 4 bytes a pixel, a
 * pixel's bytes are reconstructed at once (lanes of a vector), the left pixel kept in registers:
 * the chain is then one pixel long, not one byte, and no byte just stored is loaded again. Two
 * Paeth rows in a row are done together, so that their two chains overlap.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint8_t u8x4 __attribute__((vector_size(4)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

enum { SUB = 1, UP = 2, AVERAGE = 3, PAETH = 4 };

/* the spec's Paeth predictor without branches: of a (left), b (above), c (above left), the one
 * nearest p = a + b - c, ties to a then b (|p - a| = |b - c|, |p - b| = |a - c|, |p - c| = |a + b - 2c|) */
static inline int paeth(int a, int b, int c)
{
    const int pa = abs(b - c), pb = abs(a - c), pc = abs(a + b - 2 * c);
    const int b_or_c = pb <= pc ? b : c, nearest = pb <= pc ? pb : pc;
    return pa <= nearest ? a : b_or_c;
}

/* four bytes at p, widened (a pixel of 3 bytes reads one more, unused) */
static inline i32x4 load4(const uint8_t *p)
{
    u8x4 v;
    memcpy(&v, p, 4);
    return __builtin_convertvector(v, i32x4);
}

static inline i32x4 absolute(i32x4 v)
{
    const i32x4 negative = v >> 31;
    return (v ^ negative) - negative;
}

/* one pixel's reconstructed bytes 0..255 (int32 lanes) by `type` from its left, above and
 * above-left pixels and its filtered bytes x; Paeth's choice is `paeth`'s in each lane */
static inline __attribute__((always_inline)) i32x4 predict(int type, i32x4 a, i32x4 b, i32x4 c, i32x4 x)
{
    if (type == SUB)
        return (x + a) & 0xFF;
    if (type == AVERAGE)
        return (x + ((a + b) >> 1)) & 0xFF;
    const i32x4 b_c = b - c, a_c = a - c; /* |p - c| = |(a - c) + (b - c)|: a passes few operations */
    const i32x4 pa = absolute(b_c), pb = absolute(a_c), pc = absolute(a_c + b_c);
    const i32x4 take_b = pb <= pc, take_a = (pa <= pb) & (pa <= pc); /* lanes of all ones or zeros */
    const i32x4 b_or_c = c + ((b - c) & take_b);
    return (x + b_or_c + ((a - b_or_c) & take_a)) & 0xFF;
}

/* bytes [from, to) of a Sub, Average or Paeth row, a pixel at a time, for bpp 3 or 4 (a
 * constant where inlined); every 4-byte read lies within its row (i + 4 <= to) */
static inline __attribute__((always_inline)) int64_t pixels(int type, int bpp, const uint8_t *in, const uint8_t *up,
                                                            uint8_t *row, int64_t from, int64_t to)
{
    i32x4 left = load4(row + from - bpp);
    int64_t i = from;
    for (; i + 4 <= to; i += bpp) {
        left = predict(type, left, load4(up + i), load4(up + i - bpp), load4(in + i));
        const u8x4 v = __builtin_convertvector(left, u8x4);
        memcpy(row + i, &v, (size_t)bpp);
    }
    return i;
}

/* one byte of a Sub, Average or Paeth row */
static inline int byte(int type, int a, int b, int c, int x)
{
    return (uint8_t)(x + (type == SUB ? a : type == AVERAGE ? (a + b) >> 1 : paeth(a, b, c)));
}

/* one Sub, Average or Paeth row: the first pixel (no left neighbour) and the bytes no vector
 * covers byte by byte */
static void unfilter_row(int type, const uint8_t *in, const uint8_t *up, uint8_t *row, int64_t row_bytes,
                         int64_t bpp)
{
    int64_t i = 0;
    for (; i < bpp && i < row_bytes; i++)
        row[i] = (uint8_t)byte(type, 0, up[i], 0, in[i]);
    if (i + 4 <= row_bytes) {
        if (bpp == 3)
            i = pixels(type, 3, in, up, row, i, row_bytes);
        else if (bpp == 4)
            i = pixels(type, 4, in, up, row, i, row_bytes);
    }
    for (; i < row_bytes; i++)
        row[i] = (uint8_t)byte(type, row[i - bpp], up[i], up[i - bpp], in[i]);
}

/* bytes [from, to) of two Paeth rows at once, row0 above row1, a pixel of each at a time: row1's
 * pixel takes row0's just made as its above (registers, not memory), so the two chains overlap */
static inline __attribute__((always_inline)) int64_t paeth_pixel_pairs(int bpp, const uint8_t *in0, const uint8_t *in1,
                                                                       const uint8_t *up0, uint8_t *row0, uint8_t *row1,
                                                                       int64_t from, int64_t to)
{
    i32x4 left0 = load4(row0 + from - bpp), left1 = load4(row1 + from - bpp), above_left1 = left0;
    int64_t i = from;
    for (; i + 4 <= to; i += bpp) {
        const i32x4 above1 = predict(PAETH, left0, load4(up0 + i), load4(up0 + i - bpp), load4(in0 + i));
        left1 = predict(PAETH, left1, above1, above_left1, load4(in1 + i));
        above_left1 = left0 = above1;
        const u8x4 v0 = __builtin_convertvector(above1, u8x4), v1 = __builtin_convertvector(left1, u8x4);
        memcpy(row0 + i, &v0, (size_t)bpp);
        memcpy(row1 + i, &v1, (size_t)bpp);
    }
    return i;
}

/* two consecutive Paeth rows (bpp 3 or 4): the first pixels and the tails byte by byte, row0's first */
static void unfilter_paeth_pair(const uint8_t *in0, const uint8_t *in1, const uint8_t *up0, uint8_t *row0,
                                uint8_t *row1, int64_t row_bytes, int64_t bpp)
{
    int64_t i = 0, j;
    for (; i < bpp && i < row_bytes; i++) {
        row0[i] = (uint8_t)byte(PAETH, 0, up0[i], 0, in0[i]);
        row1[i] = (uint8_t)byte(PAETH, 0, row0[i], 0, in1[i]);
    }
    if (i + 4 <= row_bytes)
        i = bpp == 3 ? paeth_pixel_pairs(3, in0, in1, up0, row0, row1, i, row_bytes)
                     : paeth_pixel_pairs(4, in0, in1, up0, row0, row1, i, row_bytes);
    for (j = i; j < row_bytes; j++)
        row0[j] = (uint8_t)byte(PAETH, row0[j - bpp], up0[j], up0[j - bpp], in0[j]);
    for (j = i; j < row_bytes; j++)
        row1[j] = (uint8_t)byte(PAETH, row1[j - bpp], row0[j], row0[j - bpp], in1[j]);
}

int mmserve_png_unfilter(const uint8_t *raw, int64_t rows, int64_t row_bytes, int64_t bpp, uint8_t *out)
{
    uint8_t *zeros = calloc((size_t)row_bytes, 1); /* the row above the first */
    if (zeros == NULL)
        return 2;
    int status = 0;
    for (int64_t y = 0; y < rows; y++) {
        const uint8_t type = raw[y * (row_bytes + 1)];
        const uint8_t *in = raw + y * (row_bytes + 1) + 1;
        uint8_t *row = out + y * row_bytes;
        const uint8_t *up = y > 0 ? row - row_bytes : zeros; /* the row above, reconstructed */
        if (type > PAETH) {
            status = 1;
            break;
        }
        if (type == PAETH && y + 1 < rows && raw[(y + 1) * (row_bytes + 1)] == PAETH && (bpp == 3 || bpp == 4)) {
            unfilter_paeth_pair(in, in + row_bytes + 1, up, row, row + row_bytes, row_bytes, bpp);
            y++; /* both rows done */
        } else if (type == 0)
            memcpy(row, in, (size_t)row_bytes);
        else if (type == UP)
            for (int64_t i = 0; i < row_bytes; i++)
                row[i] = (uint8_t)(in[i] + up[i]);
        else
            unfilter_row(type, in, up, row, row_bytes, bpp);
    }
    free(zeros);
    return status;
}
