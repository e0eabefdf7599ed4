/* fp32 rows times an int8 weight packed in panels, on CPU: the projections of a model served with
 * `quantization int8` (weight-only int8, symmetric, one fp32 scale per output channel). The same
 * loop as the fp32 panels (cpu_panel.h, cpu_panel_loop.h):
 *
 * - panel_linear_int8: out[m, n] ~ (a[m, k] @ Wq[n, k].T) * scale[n], a and out fp32.
 *
 * Which tile runs is fixed when the library is compiled (panel_int8_dot() says which):
 *
 * - int8 x int8 (cpu_panel_int8_dot.h), where the build targets AVX512-VNNI (-march=native on
 *   such a CPU, e.g. Zen 4, Ice Lake and later Xeons): each row of a is quantized to int8 with a
 *   scale of its own as it is copied, vpdpbusd sums the int8 products exactly in int32 (64 a
 *   512-bit instruction, where an fp32 FMA does 16, and no widening), and each sum is
 *   multiplied by the row's scale times the column's once. The result is that exact sum of the
 *   quantized row and weight, scaled, not the fp32 product with the dequantized weight: the row's
 *   rounding to int8 (half its scale an element at most) is the difference.
 * - widening (cpu_panel_widen.h) everywhere else (the x86-64-v3 build, AVX2-only CPUs, CPUs
 *   without VNNI): each panel row's int8 widened to fp32 in registers (vpmovsxbd + vcvtdq2ps), fp32
 *   FMAs over k in order, each sum times its column's scale at the end: within fp32
 *   summation-order error of the product with the dequantized weight (Wq * scale).
 *
 * The panel layouts differ (each tile's header says its own); pack_panels_int8 (panel_bindings.py)
 * asks panel_int8_dot() which to write. Either way at decode sizes the tile does only the rows
 * of `a` there are, and a row's result does not depend on the other rows.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_panel.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && VW == 16
#define INT8_DOT 1
#include "cpu_panel_int8_dot.h"
#else
#define INT8_DOT 0
#include "cpu_panel_widen.h"
#define SCALE_BYTES NARROW_SCALE_BYTES(NARROW_INT8)
#endif

int64_t panel_width_int8(void) { return NR; }

/* 1 where the panels are the int8 x int8 tile's (cpu_panel_int8_dot.h), 0 the widening one's. */
int64_t panel_int8_dot(void) { return INT8_DOT; }

/* The widest k a product takes (the int8 x int8 sums' int32 limit; any k when widening). */
int64_t panel_max_k_int8(void) {
#if INT8_DOT
    return DOT_MAX_K;
#else
    return INT64_MAX;
#endif
}

#if INT8_DOT
static inline int64_t panel_bytes(int64_t k) { return panel_bytes_dot(k); }

static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    block_rows_dot(a_rows, m, k, a_stride, rb, at);
}

/* c = one MR x NR tile over the k4 groups (steps - 1: the last step holds the row scales). */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t steps, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    dot_tile(at_block, panel_start, steps - 1, rows, prefetch, prefetch_lines, c);
}

/* The copy of a row block: k4 groups, then the row scales. */
static inline int64_t copy_steps(int64_t k) { return dot_groups(k) + 1; }
#else

/* A panel: NR fp32 scales, k rows of NR int8, zero bytes up to a multiple of 64. */
static inline int64_t panel_bytes(int64_t k) { return (SCALE_BYTES + k * NR + 63) / 64 * 64; }

static void block_rows(const void *a_rows, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       void *at) {
    block_rows_fp32(a_rows, m, k, a_stride, rb, at);
}

/* c = one MR x NR tile over k (cpu_panel_widen.h); meanwhile the next panel's slice is
 * prefetched. */
static inline __attribute__((always_inline)) void tile(
    const void *at_block, const void *panel_start, int64_t k, int rows, const char *prefetch,
    int64_t prefetch_lines, vf c[MR][NRV]) {
    narrow_tile(at_block, panel_start, k, rows, prefetch, prefetch_lines, c, NARROW_INT8);
}

static inline int64_t copy_steps(int64_t k) { return k; }
#endif

#include "cpu_panel_loop.h"

/* The bytes of one panel of a weight with k columns (the packing in panel_bindings.py reads it). */
int64_t panel_bytes_int8(int64_t k) { return panel_bytes(k); }

/* a [m, k] fp32 (rows a_stride apart), packed [ceil(n / NR), panel_bytes(k)] -> out [m, n] =
 * (a @ Wq.T) * scale (as the tile computes it). Returns 0, -1 when it cannot allocate its buffer,
 * or -2 for k past panel_max_k_int8(). */
int panel_linear_int8(const float *a, int64_t m, int64_t k, int64_t a_stride, const int8_t *packed,
                      int64_t n, float *out) {
    if (k > panel_max_k_int8()) return -2;
    const int64_t steps = copy_steps(k);
    void *at = alloc_rows(m, steps);
    if (!at) return -1;
    const epilogue e = {m, n, out, NULL, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, steps, packed, &e, 0);
    free(at);
    return 0;
}
