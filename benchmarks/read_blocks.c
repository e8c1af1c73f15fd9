/* The read floor of CPU decode attention (benchmarks/decode_attention.py): every byte of each
 * request's K and V blocks read once, in table order (a block's K, then its V), the next block
 * prefetched as in models/attention/csrc/paged_decode.c, and nothing computed but an XOR of the
 * words read. Layouts as that kernel's: caches [N, block_bytes], tables [B, W] int64, seq_lens [B]
 * int64 (keys per request), S keys per block. Returns the XOR (so the reads cannot be elided).
 */
#include <stdint.h>
#include <string.h>

static uint64_t read_block(const char *block, const char *next, int64_t bytes) {
    uint64_t acc[8] = {0};
    for (int64_t at = 0; at < bytes; at += 64) {
        __builtin_prefetch(next + at);
        uint64_t words[8];
        memcpy(words, block + at, sizeof words);
        for (int w = 0; w < 8; w++) acc[w] ^= words[w];
    }
    return acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
}

uint64_t mmserve_read_blocks(const char *k_cache, const char *v_cache, const int64_t *tables,
                             const int64_t *seq_lens, int64_t B, int64_t W, int64_t S, int64_t block_bytes) {
    uint64_t x = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *table = tables + b * W, blocks = (seq_lens[b] + S - 1) / S;
        for (int64_t j = 0; j < blocks; j++) {
            const int64_t at = table[j] * block_bytes, next = table[j + 1 < blocks ? j + 1 : j] * block_bytes;
            x ^= read_block(k_cache + at, k_cache + next, block_bytes);
            x ^= read_block(v_cache + at, v_cache + next, block_bytes);
        }
    }
    return x;
}
