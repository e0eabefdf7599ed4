/* The tile of the panels whose weights are narrower than their fp32 arithmetic
 * (cpu_panel_gemm_int8.c: int8 with fp32 scales, where the build has no AVX512-VNNI for its
 * int8 x int8 tile; cpu_panel_gemm_bf16_weights.c: bf16), shared so
 * that neither copies the other's loop. Included by each after cpu_panel.h, before it defines
 * `tile` (cpu_panel_loop.h) as a call of narrow_tile with its format.
 *
 * A tile of MR x NR is k steps: NR weights of a panel row widened to fp32 in registers (int8:
 * vpmovsxbd + vcvtdq2ps; bf16: vpmovzxwd + vpslld 16, exact, since a bf16 is the high half of
 * its fp32), then one broadcast FMA per row and vector, summing over k in order, as the fp32
 * panels do; an int8 tile then multiplies each sum by its column's scale once. The rows of `a`
 * are the fp32 panels' copy, [row block][k][MR] floats.
 *
 * At decode sizes a row block has fewer than MR rows of a (one row at concurrency 1): the tile
 * then does only those rows' FMAs (a tile per row count, so the loops stay unrolled), since a
 * narrow panel row is a half or a quarter of the bytes of an fp32 one and MR rows of FMAs on it
 * would leave the core, not the memory, the limit. A row's result does not depend on the other
 * rows, and each FMA is the fp32 panels' on the same values, so bf16 weights give the fp32
 * panels' products of the widened weight to the bit.
 */
#ifndef ACTORSERVE_CPU_PANEL_WIDEN_H
#define ACTORSERVE_CPU_PANEL_WIDEN_H

#include <stdint.h>

#include "cpu_panel.h"

typedef enum { NARROW_INT8, NARROW_BF16 } narrow_format;

/* NR fp32 scales ahead of an int8 panel's rows (none ahead of a bf16 one's). */
#define NARROW_SCALE_BYTES(format) ((format) == NARROW_INT8 ? 4 * NR : 0)

/* The first R rows of a tile (R and format constants once inlined); rows past R are left
 * zero. `panel`: its scales (int8) then k rows of NR weights. */
INLINE void narrow_tile_rows(const float *at, const char *panel, int64_t k, const char *prefetch,
                             int64_t prefetch_lines, vf c[MR][NRV], const int R,
                             const narrow_format format) {
    const char *w = panel + NARROW_SCALE_BYTES(format);
    const int64_t row_bytes = format == NARROW_INT8 ? NR : 2 * NR;
    const int64_t lines_per_step = (prefetch_lines + k - 1) / k;
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NRV; v++) c[r][v] = splat(0.0f);
    for (int64_t i = 0; i < k; i++) {
        vf b[NRV];
        for (int v = 0; v < NRV; v++)
            b[v] = format == NARROW_INT8
                       ? load_int8((const int8_t *)(w + i * row_bytes) + v * VW)
                       : load_bf16((const uint16_t *)(w + i * row_bytes) + v * VW);
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
    if (format == NARROW_INT8) {
        vf s[NRV];
        for (int v = 0; v < NRV; v++) s[v] = load((const float *)panel + v * VW);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NRV; v++) c[r][v] *= s[v];
    }
}

/* c = one MR x NR tile over k: its first `rows` rows; meanwhile the next panel's slice is
 * prefetched. */
INLINE void narrow_tile(const void *at_block, const void *panel_start, int64_t k, int rows,
                        const char *prefetch, int64_t prefetch_lines, vf c[MR][NRV],
                        const narrow_format format) {
    const float *at = at_block;
    const char *panel = panel_start;
    switch (rows) {
#define ROWS(R)                                                                 \
    case R:                                                                     \
        narrow_tile_rows(at, panel, k, prefetch, prefetch_lines, c, R, format); \
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
        narrow_tile_rows(at, panel, k, prefetch, prefetch_lines, c, MR, format);
    }
}

#endif
