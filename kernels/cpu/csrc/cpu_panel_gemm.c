/* fp32 products of a few rows against a weight packed in panels, on CPU: the decode step's
 * shapes (tens of rows a step), where MKL's GEMM waits on weights that the step's K/V stream
 * evicted from cache. Two entry points share the loop (cpu_panel.h):
 *
 * - panel_linear: out = a @ W.T, a [m, k], W [n, k] (a Linear layer's weight);
 * - greedy_head: for each row of a, the first column of the maximum of a @ W.T, without ever
 *   writing those products (the LM head and greedy sampling fused: each tile of logits is
 *   compared while it is still in registers, instead of megabytes of logits read back).
 *
 * W comes packed in panels of NR columns: panel p is k rows of NR floats, element (i, j) holding
 * W[p * NR + j][i]; columns past n are zero and never stored or chosen. The rows are taken MR at
 * a time (a copy of `a` transposed to [row block][k][MR], zero rows past m). A tile of MR x NR
 * products is k broadcast-FMA steps, summing over k in order: a row's result does not depend on
 * the other rows. The panels are shared out by OpenMP in contiguous ranges, and each thread
 * prefetches the next panel into L2 while it computes this one, so the weight streams from
 * memory under the FMAs.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_panel.h"

int64_t panel_width(void) { return NR; }

/* Row block rb of a [m, k] -> at's [k][MR] (zero rows past m). */
static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    block_rows_fp32(a_rows, m, k, a_stride, rb, at);
}

/* A panel: k rows of NR floats. */
static inline int64_t panel_bytes(int64_t k) { return 4 * k * NR; }

/* c = one MR x NR tile of products over k (all MR rows: those past m multiply zeros);
 * meanwhile the next panel's slice is prefetched. */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t k, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    (void)rows;
    const float *at = at_block, *panel = panel_start;
    const int64_t lines_per_step = (prefetch_lines + k - 1) / k;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NRV; v++) c[r][v] = splat(0.0f);
    for (int64_t i = 0; i < k; i++) {
        vf b[NRV];
        for (int v = 0; v < NRV; v++) b[v] = load(panel + i * NR + v * VW);
        for (int64_t j = i * lines_per_step; j < (i + 1) * lines_per_step && j < prefetch_lines; j++)
            __builtin_prefetch(prefetch + j * 64, 0, 2);
        const float *a = at + i * MR;
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const vf ar = splat(a[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++) c[r][v] = fmadd(ar, b[v], c[r][v]);
        }
    }
}

#include "cpu_panel_loop.h"

/* a [m, k] (rows a_stride apart), packed [ceil(n / NR), k, NR] -> out [m, n] = a @ W.T.
 * Returns 0, or -1 when it cannot allocate its buffer. */
int panel_linear(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                 int64_t n, float *out) {
    void *at = alloc_rows(m, k);
    if (!at) return -1;
    const epilogue e = {m, n, out, NULL, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, k, packed, &e, 0);
    free(at);
    return 0;
}

/* a [m, k] (rows a_stride apart), packed [ceil(n / NR), k, NR] -> out[m] the first argmax of each
 * row of a @ W.T over n columns. Returns 0, or -1 when it cannot allocate its buffers. */
int greedy_head(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                int64_t n, int64_t *out) {
    return greedy_tiles(a, m, k, k, a_stride, packed, n, out);
}
