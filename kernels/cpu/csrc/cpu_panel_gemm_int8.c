/* fp32 rows times an int8 weight packed in panels, on CPU: the projections of a model served with
 * `quantization int8` (weight-only, symmetric, one fp32 scale per output channel). A decode step
 * is bound by the bytes of weight it reads, and an int8 weight is a quarter of the fp32 one; the
 * arithmetic stays fp32. The same loop as the fp32 panels (cpu_panel.h, cpu_panel_loop.h):
 *
 * - panel_linear_int8: out[m, n] = (a[m, k] @ Wq[n, k].T) * scale[n], a and out fp32.
 *
 * W comes packed in panels of NR columns, each panel_bytes(k) long (a multiple of 64, so every
 * panel starts a cache line): first the NR fp32 scales of its columns, then k rows of NR int8,
 * element (i, j) holding Wq[p * NR + j][i]; columns past n are zero (scale and weights) and never
 * stored. The rows of `a` are copied as the fp32 panels copy them, [row block][k][MR]. A tile of
 * MR x NR is k steps: NR int8 of a panel row widened to fp32 in registers (vpmovsxbd +
 * vcvtdq2ps, 16 or 8 lanes at a time), then one broadcast FMA per row and vector, summing over k
 * in order; each sum is multiplied by its column's scale once, at the end. Every product
 * a[i] * Wq[j][i] rounds as fp32 arithmetic does, so the result lies within fp32 summation-order
 * error of the product with the dequantized weight (Wq * scale), not equal to it to the bit.
 *
 * At decode sizes a row block has fewer than MR rows of a (one row at concurrency 1): the tile
 * then does only those rows' FMAs (a tile per row count, so the loops stay unrolled), since an
 * int8 panel row is a quarter of the bytes of an fp32 one and MR rows of FMAs on it would leave
 * the core, not the memory, the limit. A row's result does not depend on the other rows.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_panel.h"

#define SCALE_BYTES (4 * NR)

int64_t panel_width_int8(void) { return NR; }

/* A panel: NR fp32 scales, k rows of NR int8, zero bytes up to a multiple of 64. */
static inline int64_t panel_bytes(int64_t k) { return (SCALE_BYTES + k * NR + 63) / 64 * 64; }

/* The bytes of one panel of a weight with k columns (the packing in bindings.py reads it). */
int64_t panel_bytes_int8(int64_t k) { return panel_bytes(k); }

static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    block_rows_fp32(a_rows, m, k, a_stride, rb, at);
}

/* The first R rows of a tile (R a constant once inlined); rows past R are left zero. */
INLINE void tile_rows(const float *at, const int8_t *w, const float *scale, int64_t k,
                      const char *prefetch, int64_t prefetch_lines, vf c[MR][NRV], const int R) {
    const int64_t lines_per_step = (prefetch_lines + k - 1) / k;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NRV; v++) c[r][v] = splat(0.0f);
    for (int64_t i = 0; i < k; i++) {
        vf b[NRV];
        for (int v = 0; v < NRV; v++) b[v] = load_int8(w + i * NR + v * VW);
        for (int64_t j = i * lines_per_step; j < (i + 1) * lines_per_step && j < prefetch_lines;
             j++)
            __builtin_prefetch(prefetch + j * 64, 0, 2);
        const float *a = at + i * MR;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vf ar = splat(a[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++) c[r][v] = fmadd(ar, b[v], c[r][v]);
        }
    }
    vf s[NRV];
    for (int v = 0; v < NRV; v++) s[v] = load(scale + v * VW);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NRV; v++) c[r][v] *= s[v];
}

/* c = one MR x NR tile over k: its first `rows` rows; meanwhile the next panel's slice is
 * prefetched. */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t k, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    const float *at = at_block, *scale = panel_start;
    const int8_t *w = (const int8_t *)panel_start + SCALE_BYTES;
    switch (rows) {
#define ROWS(R)                                                       \
    case R:                                                           \
        tile_rows(at, w, scale, k, prefetch, prefetch_lines, c, R); \
        return;
        ROWS(1)
        ROWS(2)
        ROWS(3)
#if MR > 4
        ROWS(4)
        ROWS(5)
        ROWS(6)
        ROWS(7)
#endif
#undef ROWS
    default:
        tile_rows(at, w, scale, k, prefetch, prefetch_lines, c, MR);
    }
}

#include "cpu_panel_loop.h"

/* a [m, k] fp32 (rows a_stride apart), packed [ceil(n / NR), panel_bytes(k)] -> out [m, n] =
 * (a @ Wq.T) * scale. Returns 0, or -1 when it cannot allocate its buffer. */
int panel_linear_int8(const float *a, int64_t m, int64_t k, int64_t a_stride, const int8_t *packed,
                      int64_t n, float *out) {
    void *at = alloc_rows(m, k);
    if (!at) return -1;
    const epilogue e = {m, n, out, NULL, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, k, packed, &e, 0);
    free(at);
    return 0;
}
