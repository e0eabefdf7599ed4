/* The flat inputs of a step of decodes (one token per request), in one pass: what the runner's
 * numpy path (actors/worker/runner.py prepare) computes, without its two dozen numpy calls, each
 * slow on the caches a step has just streamed through.
 *
 * Request i is requests[4 i .. 4 i + 3] = (tokens computed, blocks held, its row of the block
 * table array `table`, rows table_stride apart; its token at that position); with starts[i],
 * num_blocks[i], rows[i], tokens[i] those:
 *   input_ids[i] = tokens[i], positions[i] = starts[i], seq_lens[i] = starts[i] + 1,
 *   query_start_loc = 0, 1, ..., n,
 *   slots[i] = table[rows[i]][p / block_size] * block_size + p % block_size (p = starts[i]),
 *   tables_out[i][0..width) = table[rows[i]][0..width), width = max num_blocks (rows
 *   tables_out_stride apart, which must be >= width).
 * Returns width; or -1 - i when request i's token lies past its blocks (outputs then invalid).
 *
 * With next_tokens (else NULL), each request first moves on by the token the step before
 * sampled for it: starts[i] += 1, tokens[i] = next_tokens[i] (written back to requests).
 */
#include <stdint.h>
#include <string.h>

int64_t decode_inputs(int64_t *requests, int64_t n, const int32_t *table,
                      int64_t table_stride, int64_t block_size, int64_t *input_ids,
                      int64_t *positions, int64_t *slots,
                      int32_t *tables_out, int64_t tables_out_stride, int32_t *seq_lens,
                      int32_t *query_start_loc, const int64_t *next_tokens) {
    int64_t width = 0;
    for (int64_t i = 0; i < n; i++) {
        if (next_tokens != 0) {
            requests[4 * i] += 1;
            requests[4 * i + 3] = next_tokens[i];
        }
        const int64_t start = requests[4 * i], blocks = requests[4 * i + 1];
        if (start < 0 || start + 1 > blocks * block_size || blocks > tables_out_stride)
            return -1 - i;
        if (blocks > width) width = blocks;
    }
    for (int64_t i = 0; i < n; i++) {
        const int32_t *row = table + requests[4 * i + 2] * table_stride;
        const int64_t p = requests[4 * i];
        input_ids[i] = requests[4 * i + 3];
        positions[i] = p;
        seq_lens[i] = (int32_t)(p + 1);
        query_start_loc[i] = (int32_t)i;
        slots[i] = (int64_t)row[p / block_size] * block_size + p % block_size;
        memcpy(tables_out + i * tables_out_stride, row, sizeof(int32_t) * width);
    }
    query_start_loc[n] = (int32_t)n;
    return width;
}
