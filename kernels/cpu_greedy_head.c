/* Greedy sampling fused into the LM head on CPU: for each row of hidden states a [m, k], the
 * first column of the maximum of a @ W.T (W the [n, k] LM head weight), without ever writing the
 * [m, n] logits. At decode sizes (tens of rows, a 32000-word vocabulary) those logits are
 * megabytes that a separate argmax must read back from memory; here each tile of logits is
 * compared while it is still in registers.
 *
 * W comes packed in panels of NR columns: panel p is k rows of NR floats, element (i, j) holding
 * W[p * NR + j][i]; columns past n are zero and never win (they are masked). The rows are taken
 * MR at a time (a copy of `a` transposed to [row block][k][MR], zero rows past m). A tile of MR x
 * NR logits is k broadcast-FMA steps; then each of its columns is compared with the best value
 * that row has seen in the same lane, a later column replacing it only when strictly greater.
 * The panels are shared out by OpenMP in contiguous ranges, and each thread prefetches the next
 * panel into L2 while it computes this one, so the weight streams from memory under the FMAs.
 * At the end the lanes (and threads, in column order) are combined, ties to the smaller column:
 * the result is torch's max(dim=-1).indices of the same products. A row's sums run over k in
 * order, whatever the other rows, so its token does not depend on the batch around it.
 */
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

int64_t greedy_head_panel_width(void) { return NR; }

/* aligned_alloc wants a size that is a multiple of the alignment */
static void *alloc64(int64_t bytes) { return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64)); }

/* One MR x NR tile of logits, folded into the row block's best values and columns. Meanwhile
 * prefetches `prefetch_lines` cache lines from `prefetch` (a slice of the next panel) into L2. */
static void tile(const float *at, const float *panel, int64_t k, int64_t col0, int64_t n,
                 float *best, int32_t *where, const char *prefetch, int64_t prefetch_lines) {
    const int64_t lines_per_step = (prefetch_lines + k - 1) / k;
    vf c[MR][NRV];
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
    for (int v = 0; v < NRV; v++) {
        vi col;
        for (int l = 0; l < VW; l++) col[l] = (int32_t)(col0 + v * VW + l);
        const vi valid = col < (vi){0} + (int32_t)n;
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

/* a [m, k] (rows a_stride apart), packed [ceil(n / NR), k, NR] -> out[m] the first argmax of each
 * row of a @ W.T over n columns. Returns 0, or -1 when it cannot allocate its buffers. */
int greedy_head(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                int64_t n, int64_t *out) {
    const int64_t row_blocks = (m + MR - 1) / MR, panels = (n + NR - 1) / NR;
    const int64_t lines_per_panel = k * NR * (int64_t)sizeof(float) / 64;
    int max_threads = 1;
#ifdef _OPENMP
    max_threads = omp_get_max_threads();
#endif
    const int64_t state = row_blocks * MR * NR; /* one thread's best values (and columns) */
    float *at = alloc64(sizeof(float) * row_blocks * MR * k);
    float *best = alloc64(sizeof(float) * max_threads * state);
    int32_t *where = alloc64(sizeof(int32_t) * max_threads * state);
    if (!at || !best || !where) {
        free(at), free(best), free(where);
        return -1;
    }
    for (int64_t rb = 0; rb < row_blocks; rb++)
        for (int r = 0; r < MR; r++) {
            const int64_t row = rb * MR + r;
            for (int64_t i = 0; i < k; i++)
                at[(rb * k + i) * MR + r] = row < m ? a[row * a_stride + i] : 0.0f;
        }
    for (int64_t i = 0; i < max_threads * state; i++) best[i] = -__builtin_inff(), where[i] = 0;
    int threads = 1;
#pragma omp parallel
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), nt = omp_get_num_threads();
#endif
#pragma omp single
        threads = nt;
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
        for (int64_t p = first; p < end; p++) {
            const char *next = (const char *)(packed + (p + 1) * k * NR);
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                const int64_t l0 = lines_per_panel * rb / row_blocks;
                const int64_t l1 = lines_per_panel * (rb + 1) / row_blocks;
                tile(at + rb * k * MR, packed + p * k * NR, k, p * NR, n,
                     best + t * state + rb * MR * NR, where + t * state + rb * MR * NR,
                     next + l0 * 64, p + 1 < end ? l1 - l0 : 0);
            }
        }
    }
    for (int64_t r = 0; r < m; r++) {
        float value = best[r * NR];
        int32_t column = where[r * NR];
        for (int t = 0; t < threads; t++)
            for (int j = 0; j < NR; j++) {
                const float v = best[t * state + r * NR + j];
                const int32_t w = where[t * state + r * NR + j];
                if (v > value || (v == value && w < column)) value = v, column = w;
            }
        out[r] = column;
    }
    free(at), free(best), free(where);
    return 0;
}
