/* bf16 products of a few rows against a bf16 weight packed in panels, on CPU: the decode step's
 * projections and LM head of a bf16 model, where torch's bf16 GEMM reads the weight several
 * times slower than memory delivers it. The same loop as the fp32 panels (cpu_panel.h,
 * cpu_panel_loop.h), with bf16 pairs in place of floats:
 *
 * - panel_linear_bf16: out = a @ W.T, a [m, k] bf16, W [n, k] bf16, out bf16 (rounded to
 *   nearest even, as torch rounds) or fp32 (the LM head's logits);
 * - greedy_head_bf16: for each row of a, the first column of the maximum of a @ W.T (fp32
 *   sums, never written), ties to the smaller column.
 *
 * W comes packed in panels of NR columns: panel p is k2 = ceil(k / 2) rows of NR pairs, pair
 * (i, j) holding W[p * NR + j][2i] in its low half and W[p * NR + j][2i + 1] in its high half
 * (zero past k, and zero columns past n) -- the operand vdpbf16ps reads. The rows of `a` are
 * copied as pairs the same way, [row block][k2][MR]. A tile is k2 steps, each adding both
 * products of a pair to fp32 accumulators: with AVX512-BF16 one vdpbf16ps per vector, else
 * both halves widened to fp32 (a bf16 is the high half of its fp32) and two FMAs. The results
 * agree up to the order of the sums (vdpbf16ps adds a pair's two products before the sum).
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_panel.h"

int64_t panel_width_bf16(void) { return NR; }

/* Whether the products run on vdpbf16ps (1) or widened to fp32 FMAs (0): for tests. */
int64_t panel_bf16_native(void) {
#if defined(__AVX512BF16__) && VW == 16
    return 1;
#else
    return 0;
#endif
}

/* Row block rb of a [m, k] bf16 -> at's [k2][MR] pairs (zero past k and past m). */
static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    const uint16_t *a = a_rows;
    const int64_t k2 = (k + 1) / 2;
    uint32_t *dst = (uint32_t *)at + rb * k2 * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = rb * MR + r;
        const uint16_t *src = a + row * a_stride;
        for (int64_t i = 0; i < k2; i++) {
            const uint32_t lo = row < m ? src[2 * i] : 0;
            const uint32_t hi = row < m && 2 * i + 1 < k ? src[2 * i + 1] : 0;
            dst[i * MR + r] = lo | hi << 16;
        }
    }
}

typedef uint32_t vu_mem __attribute__((vector_size(4 * VW), aligned(4), may_alias));

/* A panel: k2 = ceil(k / 2) rows of NR pairs. */
static inline int64_t panel_bytes(int64_t k) { return 4 * ((k + 1) / 2) * NR; }

/* c = one MR x NR tile of products over k2 pairs (all MR rows: those past m multiply zeros);
 * meanwhile the next panel's slice is prefetched. */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t k2, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    (void)rows;
    const uint32_t *at = at_block, *panel = panel_start;
    const int64_t lines_per_step = (prefetch_lines + k2 - 1) / k2;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NRV; v++) c[r][v] = splat(0.0f);
    for (int64_t i = 0; i < k2; i++) {
        vu b[NRV];
        for (int v = 0; v < NRV; v++) b[v] = *(const vu_mem *)(panel + i * NR + v * VW);
        for (int64_t j = i * lines_per_step; j < (i + 1) * lines_per_step && j < prefetch_lines;
             j++)
            __builtin_prefetch(prefetch + j * 64, 0, 2);
        const uint32_t *a = at + i * MR;
#if defined(__AVX512BF16__) && VW == 16
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], ar, (__m512bh)b[v]);
        }
#else
        vf even[NRV], odd[NRV];
        for (int v = 0; v < NRV; v++) even[v] = (vf)(b[v] << 16), odd[v] = (vf)(b[v] & 0xffff0000u);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const vu pair = (vu){0} + a[r];
            const vf a_even = (vf)(pair << 16), a_odd = (vf)(pair & 0xffff0000u);
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++)
                c[r][v] = fmadd(a_odd, odd[v], fmadd(a_even, even[v], c[r][v]));
        }
#endif
    }
}

#include "cpu_panel_loop.h"

/* a [m, k] bf16 (rows a_stride apart), packed [ceil(n / NR), k2, NR] pairs -> a @ W.T [m, n]
 * into out (fp32) where it is not NULL, else into out_bf16 (rounded to nearest even).
 * Returns 0, or -1 when it cannot allocate its buffer. */
int panel_linear_bf16(const uint16_t *a, int64_t m, int64_t k, int64_t a_stride,
                      const uint32_t *packed, int64_t n, float *out, uint16_t *out_bf16) {
    const int64_t k2 = (k + 1) / 2;
    void *at = alloc_rows(m, k2);
    if (!at) return -1;
    const epilogue e = {m, n, out, out_bf16, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, k2, packed, &e, 0);
    free(at);
    return 0;
}

/* a [m, k] bf16 (rows a_stride apart), packed as for panel_linear_bf16 -> out[m] the first
 * argmax of each row of a @ W.T over n columns. Returns 0, or -1 when it cannot allocate. */
int greedy_head_bf16(const uint16_t *a, int64_t m, int64_t k, int64_t a_stride,
                     const uint32_t *packed, int64_t n, int64_t *out) {
    return greedy_tiles(a, m, k, (k + 1) / 2, a_stride, packed, n, out);
}
