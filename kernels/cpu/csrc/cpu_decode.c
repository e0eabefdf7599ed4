/* Decode attention over the paged KV cache on CPU, fp32 q and out, an fp32 or a bf16 cache (sums
 * and softmax in fp32): the rows of a step whose sequence has exactly one query token. Semantics of kernels/reference.py
 * (paged_attention), restricted to those rows; rows of longer query chunks are left untouched
 * for the caller.
 *
 * Why C: a decode reads its whole context once per layer, so the cost is memory traffic. The torch
 * path gathers K/V block by block into a padded copy and then reads the copy (three passes over
 * the context); here each sequence reads its K and V straight from the cache blocks, once. Work
 * items are shared out by OpenMP; the library links the libgomp that torch has already loaded,
 * so both use one thread pool.
 *
 * Shapes (T tokens, B sequences, NB cache blocks, BS block size, D head_dim, G = Hq / Hkv):
 *   q, out            [T, Hq, D]  contiguous
 *   k_cache, v_cache  [NB, BS, Hkv, D] contiguous, fp32 (decode_attention) or bf16
 *                     (decode_attention_bf16)
 *   block_tables      [B, table_stride] int32
 *   seq_lens          [B] int32 (context length including this step's token)
 *   query_start_loc   [B + 1] int32
 * Query head h uses KV head h / G (Hugging Face's repeat_kv order).
 *
 * Work items: a sequence, all its heads; or one KV head of it when there are too few sequences
 * to keep the threads busy. Over a bf16 cache an item is cpu_decode_bf16.c's (bf16 products,
 * one pass, online softmax). Over an fp32 cache, here, in two passes over its blocks:
 * - scores: the tokens go in chunks of VW (the vector width: 16 floats with AVX-512, 8 with AVX,
 *   else 4; a chunk never crosses a block). Each token's dot product with a query head is left
 *   as a vector of VW partial sums, and one transpose-add turns the chunk's VW vectors into its
 *   VW scores, instead of a horizontal sum per token;
 * - softmax per head over its row of scores (exact max first, as the reference), with a
 *   vectorized exp (Cephes' polynomial, within 2 ulp of expf);
 * - V: out += p * V a chunk at a time, output vectors held in registers; divided by the sum last.
 * Whole sequences keep a block's reads contiguous (all its heads) for the hardware prefetchers,
 * which do not cross 4 KiB pages; the pages of the next block (an id from the table, which they
 * cannot guess) are touched one block ahead. Sequences go longest first so that the last items
 * handed out are short and the threads finish together.
 * Written with GCC vector extensions (any target gcc supports) plus FMA / max intrinsics where
 * the target has them: -std=c11 keeps gcc from contracting a * b + c by itself.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_attention.h"
#include "cpu_kernels.h"

/* Query heads [kvh * g, (kvh + nkv) * g) of one sequence against its `len` cached tokens (an
 * fp32 cache); q and out point at the first of them; scores holds nkv * g * ROW(len) floats.
 * Inlined into copies with D fixed (fully unrolled vector loops) and one for any D. */
INLINE void attend(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int32_t *restrict table, int64_t len,
                   int64_t bs, int64_t hkv, int64_t kvh, int64_t nkv, int64_t d, int64_t g,
                   float scale, float *restrict scores, float *restrict out) {
    const int64_t token_stride = hkv * d, block_stride = bs * token_stride;
    const int64_t block_bytes = block_stride * 4;
    const int64_t heads = nkv * g, row = ROW(len);
    const int64_t nblocks = (len + bs - 1) / bs;
    /* pass 1: scores[head][pos]; a chunk's lanes past its tokens are overwritten by the next
     * chunk or lie past len */
    for (int64_t b = 0; b < nblocks; b++) {
        if (b + 1 < nblocks)
            touch_pages(k_cache + (int64_t)table[b + 1] * block_stride, block_bytes);
        const int64_t start = b * bs, in_block = len - start < bs ? len - start : bs;
        const float *k = k_cache + (int64_t)table[b] * block_stride + kvh * d;
        for (int64_t c = 0; c < in_block; c += VW) {
            const int n = in_block - c < VW ? (int)(in_block - c) : VW;
            for (int64_t h = 0; h < nkv; h++)
                for (int64_t j = 0; j < g; j++)
                    store(scores + (h * g + j) * row + start + c,
                          chunk_scores(q + (h * g + j) * d, k + c * token_stride + h * d, n,
                                       token_stride, d, scale));
        }
    }
    /* softmax: scores become exp(score - max); inv keeps 1 / their sum */
    float inv[heads];
    for (int64_t j = 0; j < heads; j++) {
        inv[j] = softmax_row(scores + j * row, len);
        memset(out + j * d, 0, sizeof(float) * d);
    }
    /* pass 2: out = the exp-weighted sum of V, then / the sum */
    for (int64_t b = 0; b < nblocks; b++) {
        if (b + 1 < nblocks)
            touch_pages(v_cache + (int64_t)table[b + 1] * block_stride, block_bytes);
        const int64_t start = b * bs, in_block = len - start < bs ? len - start : bs;
        const float *v = v_cache + (int64_t)table[b] * block_stride + kvh * d;
        for (int64_t c = 0; c < in_block; c += VW) {
            const int n = in_block - c < VW ? (int)(in_block - c) : VW;
            for (int64_t h = 0; h < nkv; h++)
                for (int64_t j = 0; j < g; j++)
                    weighted_add(out + (h * g + j) * d, scores + (h * g + j) * row + start + c,
                                 v + c * token_stride + h * d, n, token_stride, d);
        }
    }
    for (int64_t j = 0; j < heads; j++) scale_head(out + j * d, d, inv[j]);
}

#define ATTEND_ARGS                                                                           \
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,    \
        const int32_t *restrict table, int64_t len, int64_t bs, int64_t hkv, int64_t kvh,     \
        int64_t nkv, int64_t d, int64_t g, float scale, float *restrict scores,               \
        float *restrict out
#define ATTEND_CALL(D) \
    attend(q, k_cache, v_cache, table, len, bs, hkv, kvh, nkv, D, g, scale, scores, out)

static void attend_64(ATTEND_ARGS) { (void)d; ATTEND_CALL(64); }
static void attend_128(ATTEND_ARGS) { (void)d; ATTEND_CALL(128); }
static void attend_any(ATTEND_ARGS) { ATTEND_CALL(d); }

/* The decode rows' work items in the order they are handed out: (context length << 32 | row),
 * longest first; *count of them, *max_len the longest context. NULL when it cannot allocate. */
int64_t *decode_order(const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                      int64_t *count, int64_t *max_len) {
    int64_t *order = malloc(sizeof(int64_t) * (num_seqs > 0 ? num_seqs : 1));
    if (order == NULL) return NULL;
    *count = 0, *max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++)
        if (query_start_loc[b + 1] - query_start_loc[b] == 1) {
            order[(*count)++] = (int64_t)seq_lens[b] << 32 | b;
            if (seq_lens[b] > *max_len) *max_len = seq_lens[b];
        }
    qsort(order, *count, sizeof(int64_t), longest_first);
    return order;
}

/* Decode attention shared out among the threads of the enclosing parallel region, every one of
 * which calls this (an orphaned `omp for`, dynamic, in `order`: decode_order), ending with them
 * all at its barrier. The caches are bf16 where kv_bf16, else fp32. Returns 0, or -1 when this
 * thread's scratch could not be allocated. */
int decode_attention_team(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, const int32_t *query_start_loc,
                          int64_t block_size, int64_t num_q_heads, int64_t num_kv_heads,
                          int64_t head_dim, float scale, const int64_t *order, int64_t count,
                          int64_t max_len, float *out) {
    const int64_t group = num_q_heads / num_kv_heads;
#if defined(_OPENMP)
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    /* Items are whole sequences (contiguous reads), unless too few to keep the threads busy:
     * then each KV head of a sequence is an item. */
    const int64_t split = count >= 4 * threads ? 1 : num_kv_heads, nkv = num_kv_heads / split;
    void (*attend_d)(ATTEND_ARGS) =
        head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    const int64_t floats = kv_bf16 ? attend_bf16_scratch(nkv * group, head_dim)
                                   : nkv * group * ROW(max_len);
    float *scratch = malloc(sizeof(float) * floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < count * split; item++) {
        if (scratch == NULL) continue;
        const int64_t b = order[item / split] & 0xffffffff;
        const int64_t kvh = item % split * nkv;
        const int64_t offset = ((int64_t)query_start_loc[b] * num_q_heads + kvh * group) * head_dim;
        if (kv_bf16)
            attend_bf16(q + offset, k_cache, v_cache, block_tables + b * table_stride, seq_lens[b],
                        block_size, num_kv_heads, kvh, nkv, head_dim, group, scale, scratch,
                        out + offset);
        else
            attend_d(q + offset, k_cache, v_cache, block_tables + b * table_stride, seq_lens[b],
                     block_size, num_kv_heads, kvh, nkv, head_dim, group, scale, scratch,
                     out + offset);
    }
    const int failed = scratch == NULL;
    free(scratch);
    return failed ? -1 : 0;
}

/* Every decode row over fp32 (kv_bf16 = 0) or bf16 caches. Returns 0, or -1 when a scratch
 * buffer could not be allocated (out is then incomplete). */
static int decode(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                  const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                  const int32_t *query_start_loc, int64_t num_seqs, int64_t block_size,
                  int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                  float *out) {
    int64_t count, max_len;
    int64_t *order = decode_order(seq_lens, query_start_loc, num_seqs, &count, &max_len);
    if (order == NULL) return -1;
    int failed = 0;
    if (count > 0) { /* else a step of prefill chunks only: no thread team, no scratch */
#pragma omp parallel reduction(| : failed)
        failed = decode_attention_team(q, k_cache, v_cache, kv_bf16, block_tables, table_stride,
                                       seq_lens, query_start_loc, block_size, num_q_heads,
                                       num_kv_heads, head_dim, scale, order, count, max_len,
                                       out) != 0;
    }
    free(order);
    return failed ? -1 : 0;
}

int decode_attention(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     const int32_t *query_start_loc, int64_t num_seqs, int64_t block_size,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     float *out) {
    return decode(q, k_cache, v_cache, 0, block_tables, table_stride, seq_lens, query_start_loc,
                  num_seqs, block_size, num_q_heads, num_kv_heads, head_dim, scale, out);
}

/* decode_attention over bf16 caches (their bits), q and out fp32. */
int decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, const int32_t *query_start_loc,
                          int64_t num_seqs, int64_t block_size, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t head_dim, float scale, float *out) {
    return decode(q, k_cache, v_cache, 1, block_tables, table_stride, seq_lens, query_start_loc,
                  num_seqs, block_size, num_q_heads, num_kv_heads, head_dim, scale, out);
}
