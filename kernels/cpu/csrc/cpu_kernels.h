/* The CPU kernels one file calls from another (cpu_decode_stack.c runs a whole decode step
 * through them); each is documented where it is defined. */
#ifndef ACTORSERVE_CPU_KERNELS_H
#define ACTORSERVE_CPU_KERNELS_H

#include <stdint.h>

int decode_attention(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     const int32_t *query_start_loc, int64_t num_seqs, int64_t block_size,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     float *out);
int decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, const int32_t *query_start_loc,
                          int64_t num_seqs, int64_t block_size, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t head_dim, float scale, float *out);
int64_t *decode_order(const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                      int64_t *count, int64_t *max_len);
int decode_attention_team(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, const int32_t *query_start_loc,
                          int64_t block_size, int64_t num_q_heads, int64_t num_kv_heads,
                          int64_t head_dim, float scale, const int64_t *order, int64_t count,
                          int64_t max_len, float *out);
int64_t attend_bf16_scratch(int64_t heads, int64_t d);
void attend_bf16(const float *restrict q, const uint16_t *restrict k_cache,
                 const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t len,
                 int64_t bs, int64_t hkv, int64_t kvh, int64_t nkv, int64_t d, int64_t g,
                 float scale, float *restrict scratch, float *restrict out);
int panel_linear(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                 int64_t n, float *out);
int panel_linear_bf16(const uint16_t *a, int64_t m, int64_t k, int64_t a_stride,
                      const uint32_t *packed, int64_t n, float *out, uint16_t *out_bf16);
int panel_linear_int8(const float *a, int64_t m, int64_t k, int64_t a_stride, const int8_t *packed,
                      int64_t n, float *out);
int panel_linear_bf16_weights(const float *a, int64_t m, int64_t k, int64_t a_stride,
                              const uint16_t *packed, int64_t n, float *out);
void rms_norm(const float *x, int64_t x_stride, const float *residual, const float *weight,
              float eps, int64_t rows, int64_t dim, float *out, float *residual_out);
void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out);
void rope(const float *x, int64_t token_stride, int64_t head_stride, int64_t tokens,
          int64_t heads, int64_t dim, const float *cos, const float *sin, float *out);
int store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
             const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
             float *k_cache, float *v_cache);
int store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
                  uint16_t *k_cache, uint16_t *v_cache);
int64_t first_max_exact(const float *a, int64_t k, const float *weight, int64_t w_row,
                        int64_t w_col, const int64_t *cols, int64_t count);

#endif
