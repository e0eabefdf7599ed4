/* fp32 rows times a bf16 weight packed in panels, on CPU: the projections of a model served with
 * `quantization bf16` (bf16 weights, fp32 activations and arithmetic), for a CPU without bf16
 * arithmetic, where a bf16 checkpoint otherwise runs upcast to fp32. A decode step is bound by
 * the bytes of weight it reads, and a bf16 weight is half the fp32 one; for a bf16 checkpoint
 * the widened weight IS the upcast model's, so nothing but bytes changes. The same loop as the
 * fp32 panels (cpu_panel.h, cpu_panel_loop.h) and the int8 panels' tile (cpu_panel_widen.h):
 *
 * - panel_linear_bf16_weights: out[m, n] = a[m, k] @ W[n, k].T, a and out fp32, W bf16.
 *
 * W comes packed in panels of NR columns, each panel_bytes(k) long (a multiple of 64, so every
 * panel starts a cache line): k rows of NR bf16, element (i, j) holding W[p * NR + j][i]; columns
 * past n are zero and never stored. (Not the bf16 panels' pairs: those interleave two of k for
 * vdpbf16ps, which this CPU lacks; a plain row widens with one vpmovzxwd + vpslld per vector.)
 * The rows of `a` are copied as the fp32 panels copy them, [row block][k][MR]. Each row of a
 * tile is the fp32 panels' FMAs on the same values in the same order, so the result is
 * panel_linear's with the weight upcast, to the bit.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_panel.h"
#include "cpu_panel_widen.h"

int64_t panel_width_bf16_weights(void) { return NR; }

/* A panel: k rows of NR bf16, zero bytes up to a multiple of 64. */
static inline int64_t panel_bytes(int64_t k) { return (2 * k * NR + 63) / 64 * 64; }

/* The bytes of one panel of a weight with k columns (the packing in panel_bindings.py reads
 * it). */
int64_t panel_bytes_bf16_weights(int64_t k) { return panel_bytes(k); }

static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    block_rows_fp32(a_rows, m, k, a_stride, rb, at);
}

/* c = one MR x NR tile over k (cpu_panel_widen.h); meanwhile the next panel's slice is
 * prefetched. */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t k, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    narrow_tile(at_block, panel_start, k, rows, prefetch, prefetch_lines, c, NARROW_BF16);
}

#include "cpu_panel_loop.h"

/* a [m, k] fp32 (rows a_stride apart), packed [ceil(n / NR), panel_bytes(k)] -> out [m, n] =
 * a @ W.T in fp32. Returns 0, or -1 when it cannot allocate its buffer. */
int panel_linear_bf16_weights(const float *a, int64_t m, int64_t k, int64_t a_stride,
                              const uint16_t *packed, int64_t n, float *out) {
    void *at = alloc_rows(m, k);
    if (!at) return -1;
    const epilogue e = {m, n, out, NULL, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, k, packed, &e, 0);
    free(at);
    return 0;
}
