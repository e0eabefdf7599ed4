/* store_kv on CPU, fp32: write this step's K and V rows into the paged cache at their slots
 * (block * block_size + offset; -1 = skip), as kernels/reference.py's store_kv. One memcpy of
 * Hkv * D floats per token and cache; k and v rows may be strided (they are views into the fused
 * qkv projection's output), each row's Hkv * D floats contiguous. A prefill's thousands of
 * tokens are shared out between the threads (the slots of a step are distinct: each token has
 * its own position).
 * Returns 0, or -1 (writing nothing) when a slot lies past the cache's capacity.
 */
#include <stdint.h>
#include <string.h>

int store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
             const int64_t *slots, int64_t tokens, int64_t row, int64_t capacity,
             float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= capacity) return -1;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, k + t * k_stride, sizeof(float) * row);
        memcpy(v_cache + slot * row, v + t * v_stride, sizeof(float) * row);
    }
    return 0;
}
