/* Decode attention over the paged KV cache on CPU, fp32: the rows of a step whose sequence has
 * exactly one query token. Semantics of kernels/reference.py (paged_attention), restricted to
 * those rows; rows of longer query chunks are left untouched for the caller.
 *
 * Why C: a decode reads its whole context once per layer, so the cost is memory traffic. The torch
 * path gathers K/V block by block into a padded copy and then reads the copy (three passes over
 * the context); here each (sequence, KV head) reads its K and V straight from the cache blocks,
 * once. Work items (sequence, KV head) are shared out by OpenMP; the library links the libgomp
 * that torch has already loaded, so both use one thread pool.
 *
 * Shapes (T tokens, B sequences, NB cache blocks, BS block size, D head_dim, G = Hq / Hkv):
 *   q, out            [T, Hq, D]  contiguous
 *   k_cache, v_cache  [NB, BS, Hkv, D] contiguous
 *   block_tables      [B, table_stride] int32
 *   seq_lens          [B] int32 (context length including this step's token)
 *   query_start_loc   [B + 1] int32
 * Query head h uses KV head h / G (Hugging Face's repeat_kv order).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* One (sequence, KV head): G query heads against `len` cached tokens, head_dim D.
 * scores holds G * len floats. Two passes over the context, block by block: scores from K, then
 * the softmax-weighted sum of V. ATTEND(D) makes a copy with D fixed at compile time (fully
 * unrolled vector loops); attend_any serves other head sizes. */
#define ATTEND_BODY(D)                                                                        \
    const int64_t token_stride = hkv * (D);                                                   \
    const int64_t block_stride = bs * token_stride;                                           \
    for (int64_t start = 0; start < len; start += bs) {                                       \
        const float *k = k_cache + (int64_t)table[start / bs] * block_stride + kvh * (D);     \
        const int64_t n = len - start < bs ? len - start : bs;                                \
        for (int64_t t = 0; t < n; t++, k += token_stride)                                    \
            for (int64_t j = 0; j < g; j++)                                                   \
                scores[j * len + start + t] = dot(q + j * (D), k, (D)) * scale;               \
    }                                                                                         \
    for (int64_t j = 0; j < g; j++) {                                                         \
        float *s = scores + j * len;                                                          \
        float m = -INFINITY;                                                                  \
        for (int64_t pos = 0; pos < len; pos++) m = s[pos] > m ? s[pos] : m;                  \
        float sum = 0.0f;                                                                     \
        for (int64_t pos = 0; pos < len; pos++) {                                             \
            s[pos] = expf(s[pos] - m);                                                        \
            sum += s[pos];                                                                    \
        }                                                                                     \
        const float inv = 1.0f / sum;                                                         \
        for (int64_t pos = 0; pos < len; pos++) s[pos] *= inv;                                \
        for (int64_t i = 0; i < (D); i++) out[j * (D) + i] = 0.0f;                            \
    }                                                                                         \
    for (int64_t start = 0; start < len; start += bs) {                                       \
        const float *v = v_cache + (int64_t)table[start / bs] * block_stride + kvh * (D);     \
        const int64_t n = len - start < bs ? len - start : bs;                                \
        for (int64_t t = 0; t < n; t++, v += token_stride)                                    \
            for (int64_t j = 0; j < g; j++) axpy(out + j * (D), scores[j * len + start + t], v, (D)); \
    }

#define ATTEND_ARGS                                                                           \
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,    \
        const int32_t *restrict table, int64_t len, int64_t bs, int64_t hkv, int64_t kvh,     \
        int64_t d, int64_t g, float scale, float *restrict scores, float *restrict out

static void attend_64(ATTEND_ARGS) { (void)d; ATTEND_BODY(64) }
static void attend_128(ATTEND_ARGS) { (void)d; ATTEND_BODY(128) }
static void attend_any(ATTEND_ARGS) { ATTEND_BODY(d) }

/* Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int decode_attention(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     const int32_t *query_start_loc, int64_t num_seqs, int64_t block_size,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     float *out) {
    const int64_t group = num_q_heads / num_kv_heads;
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * max_len);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t row = query_start_loc[b];
            if (scores == NULL || query_start_loc[b + 1] - row != 1) continue;
            const int64_t offset = (row * num_q_heads + kvh * group) * head_dim;
            void (*attend)(ATTEND_ARGS) =
                head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
            attend(q + offset, k_cache, v_cache, block_tables + b * table_stride, seq_lens[b],
                       block_size, num_kv_heads, kvh, head_dim, group, scale, scores,
                       out + offset);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
