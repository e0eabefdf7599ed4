/* What the panel products (cpu_panel_gemm.c in fp32, cpu_panel_gemm_bf16.c in bf16,
 * cpu_panel_gemm_int8.c with int8 weights, cpu_panel_gemm_bf16_weights.c with bf16 weights and fp32
 * rows) share: the tile shape, the loop over tiles with its next-panel prefetch, and what is done
 * with each tile (stored, or folded into each row's best column for the fused greedy head).
 *
 * An fp32 panel is k rows of NR floats, a bf16 panel k2 = ceil(k / 2) rows of NR pairs of bf16,
 * an int8 panel NR fp32 scales and k rows of NR int8, a bf16-weight panel k rows of NR bf16
 * (the last two padded to whole cache lines; their tile: cpu_panel_widen.h), or where the build
 * has AVX512-VNNI an int8 panel NR scales, NR int32 corrections and k4 = ceil(k / 4) groups of
 * NR x 4 int8 (cpu_panel_int8_dot.h). The copy of `a`'s rows is [row block][steps][MR] 4-byte
 * elements (steps = k floats, or k2 pairs of bf16, or k4 groups of four int8 + 128 and then one
 * step of the rows' scales). So one
 * loop serves all (cpu_panel_loop.h), given the three functions that differ: a row block's copy,
 * a panel's size and one tile's products.
 *
 * greedy_head compares each tile column with the best value its row has seen in the same lane,
 * a later column replacing it only when strictly greater; at the end the lanes (and threads, in
 * column order) are combined, ties to the smaller column: torch's max(dim=-1).indices.
 */
#ifndef ACTORSERVE_CPU_PANEL_H
#define ACTORSERVE_CPU_PANEL_H

#include <stdint.h>
#include <stdlib.h>

#include "cpu_vec.h"

#if VW == 16
#define MR 8 /* 8 x 3 accumulators, 3 panel vectors and a broadcast: 28 of 32 registers */
#else
#define MR 4 /* 16 registers */
#endif
#define NRV 3
#define NR (NRV * VW)

/* aligned_alloc wants a size that is a multiple of the alignment */
static inline void *alloc64(int64_t bytes) {
    return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
}

/* Room for a [m, k] as [row block][steps][MR] 4-byte elements; NULL when it cannot allocate */
static inline void *alloc_rows(int64_t m, int64_t steps) {
    return alloc64(4 * ((m + MR - 1) / MR * MR) * steps);
}

/* Row block rb of a [m, k] fp32 (rows a_stride apart) -> at's [k][MR] floats (zero rows past
 * m): the copy of `a` the fp32 and int8 panels read. */
static inline void block_rows_fp32(const float *a, int64_t m, int64_t k, int64_t a_stride,
                                   int64_t rb, float *at) {
    float *dst = at + rb * k * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = rb * MR + r;
        for (int64_t i = 0; i < k; i++) dst[i * MR + r] = row < m ? a[row * a_stride + i] : 0.0f;
    }
}

/* What to do with each tile: store it (panel_linear) or fold it into the rows' best columns. */
typedef struct {
    int64_t m, n;
    float *out;          /* panel_linear in fp32: [m, n] */
    uint16_t *out_bf16;  /* panel_linear in bf16 (when out is NULL): [m, n] */
    float *best;         /* greedy_head: per thread, [row blocks * MR][NR] best values */
    int32_t *where;      /* ... and their columns */
    int64_t state;       /* one thread's share of best / where */
} epilogue;

INLINE void store_tile(const epilogue *e, vf c[MR][NRV], int64_t row0, int64_t col0) {
    const int64_t rows = e->m - row0 < MR ? e->m - row0 : MR;
    const int64_t width = e->n - col0 < NR ? e->n - col0 : NR;
    for (int64_t r = 0; r < rows; r++) {
        if (e->out != NULL) {
            float *dst = e->out + (row0 + r) * e->n + col0;
            if (width == NR) {
                for (int v = 0; v < NRV; v++) store(dst + v * VW, c[r][v]);
            } else {
                float tail[NR];
                for (int v = 0; v < NRV; v++) store(tail + v * VW, c[r][v]);
                for (int64_t j = 0; j < width; j++) dst[j] = tail[j];
            }
        } else {
            uint16_t *dst = e->out_bf16 + (row0 + r) * e->n + col0;
            if (width == NR) {
                for (int v = 0; v < NRV; v++) *(vh_mem *)(dst + v * VW) = round_bf16(c[r][v]);
            } else {
                uint16_t tail[NR];
                for (int v = 0; v < NRV; v++) *(vh_mem *)(tail + v * VW) = round_bf16(c[r][v]);
                for (int64_t j = 0; j < width; j++) dst[j] = tail[j];
            }
        }
    }
}

INLINE void fold_tile(const epilogue *e, int thread, vf c[MR][NRV], int64_t row0, int64_t col0) {
    float *best = e->best + thread * e->state + row0 * NR;
    int32_t *where = e->where + thread * e->state + row0 * NR;
    for (int v = 0; v < NRV; v++) {
        vi col;
        for (int l = 0; l < VW; l++) col[l] = (int32_t)(col0 + v * VW + l);
        const vi valid = col < (vi){0} + (int32_t)e->n;
        for (int r = 0; r < MR; r++) {
            float *bp = best + r * NR + v * VW;
            int32_t *wp = where + r * NR + v * VW;
            const vf old = load(bp);
            const vi greater = (c[r][v] > old) & valid;
            store(bp, vselect(greater, c[r][v], old));
            *(vi *)wp = (greater & col) | (~greater & *(vi *)wp);
        }
    }
}

#endif
