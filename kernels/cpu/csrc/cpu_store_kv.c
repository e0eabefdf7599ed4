/* store_kv on CPU: write this step's K and V rows into the paged cache at their slots
 * (block * block_size + offset; -1 = skip), as kernels/reference.py's store_kv, for an fp32
 * cache from fp32 rows (store_kv) or a bf16 cache from bf16 rows (store_kv_bf16: a bf16 model's
 * own K/V, nothing to round). One memcpy of Hkv * D elements per token and cache; k and v rows
 * may be strided (they are views into the fused qkv projection's output), each row's Hkv * D
 * elements contiguous. A prefill's thousands of tokens are shared out between the threads (the
 * slots of a step are distinct: each token has its own position).
 * Returns 0, or -1 (writing nothing) when a slot lies past the cache's capacity.
 */
#include <stdint.h>
#include <string.h>

/* Strides and `row` in elements of `size` bytes. */
static int store_rows(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                      const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
                      char *k_cache, char *v_cache, int64_t size) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= capacity) return -1;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row * size, k + t * k_stride * size, size * row);
        memcpy(v_cache + slot * row * size, v + t * v_stride * size, size * row);
    }
    return 0;
}

int store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
             const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
             float *k_cache, float *v_cache) {
    return store_rows((const char *)k, k_stride, (const char *)v, v_stride, slots, tokens, row,
                      capacity, (char *)k_cache, (char *)v_cache, sizeof(float));
}

int store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
                  uint16_t *k_cache, uint16_t *v_cache) {
    return store_rows((const char *)k, k_stride, (const char *)v, v_stride, slots, tokens, row,
                      capacity, (char *)k_cache, (char *)v_cache, sizeof(uint16_t));
}
