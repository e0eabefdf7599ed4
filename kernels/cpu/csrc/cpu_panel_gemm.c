/* fp32 products of a few rows against a weight packed in panels, on CPU: the decode step's
 * shapes (tens of rows a step), where MKL's GEMM waits on weights that the step's K/V stream
 * evicted from cache. Two entry points share the loop:
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
 *
 * greedy_head compares each tile column with the best value its row has seen in the same lane,
 * a later column replacing it only when strictly greater; at the end the lanes (and threads, in
 * column order) are combined, ties to the smaller column: torch's max(dim=-1).indices.
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

int64_t panel_width(void) { return NR; }

/* aligned_alloc wants a size that is a multiple of the alignment */
static void *alloc64(int64_t bytes) { return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64)); }

/* Row block rb of a [m, k] -> at's [k][MR] (zero rows past m). */
static void block_rows(const float *a, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
                       float *at) {
    float *dst = at + rb * k * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = rb * MR + r;
        for (int64_t i = 0; i < k; i++) dst[i * MR + r] = row < m ? a[row * a_stride + i] : 0.0f;
    }
}

/* Room for a [m, k] as [row block][k][MR]; NULL when it cannot allocate */
static float *alloc_rows(int64_t m, int64_t k) {
    return alloc64(sizeof(float) * (m + MR - 1) / MR * MR * k);
}

/* c = one MR x NR tile of products. Meanwhile prefetches `prefetch_lines` cache lines from
 * `prefetch` (a slice of the next panel) into L2. */
static inline __attribute__((always_inline)) void tile(
    const float *at, const float *panel, int64_t k, const char *prefetch, int64_t prefetch_lines,
    vf c[MR][NRV]) {
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

/* What to do with each tile: store it (panel_linear) or fold it into the rows' best columns. */
typedef struct {
    int64_t m, n;
    float *out;      /* panel_linear: [m, n] */
    float *best;     /* greedy_head: per thread, [row blocks * MR][NR] best values */
    int32_t *where;  /* ... and their columns */
    int64_t state;   /* one thread's share of best / where */
} epilogue;

static inline __attribute__((always_inline)) void store_tile(
    const epilogue *e, vf c[MR][NRV], int64_t row0, int64_t col0) {
    const int64_t rows = e->m - row0 < MR ? e->m - row0 : MR;
    const int64_t width = e->n - col0 < NR ? e->n - col0 : NR;
    for (int64_t r = 0; r < rows; r++) {
        float *dst = e->out + (row0 + r) * e->n + col0;
        if (width == NR) {
            for (int v = 0; v < NRV; v++) store(dst + v * VW, c[r][v]);
        } else {
            float tail[NR];
            for (int v = 0; v < NRV; v++) store(tail + v * VW, c[r][v]);
            for (int64_t j = 0; j < width; j++) dst[j] = tail[j];
        }
    }
}

static inline __attribute__((always_inline)) void fold_tile(
    const epilogue *e, int thread, vf c[MR][NRV], int64_t row0, int64_t col0) {
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

/* Every tile of a @ W.T, each thread a contiguous range of panels, after the threads have
 * copied a's row blocks into at (alloc_rows) together; returns the threads used. */
static int for_each_tile(const float *a, int64_t a_stride, float *at, int64_t m, int64_t k,
                         const float *packed, const epilogue *e, int greedy) {
    const int64_t row_blocks = (m + MR - 1) / MR, panels = (e->n + NR - 1) / NR;
    const int64_t lines_per_panel = k * NR * (int64_t)sizeof(float) / 64;
    int threads = 1;
#pragma omp parallel
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), nt = omp_get_num_threads();
#endif
#pragma omp single nowait
        threads = nt;
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) block_rows(a, m, k, a_stride, rb, at);
        const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
        vf c[MR][NRV];
        for (int64_t p = first; p < end; p++) {
            const char *next = (const char *)(packed + (p + 1) * k * NR);
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                const int64_t l0 = lines_per_panel * rb / row_blocks;
                const int64_t l1 = lines_per_panel * (rb + 1) / row_blocks;
                tile(at + rb * k * MR, packed + p * k * NR, k, next + l0 * 64,
                     p + 1 < end ? l1 - l0 : 0, c);
                if (greedy)
                    fold_tile(e, t, c, rb * MR, p * NR);
                else
                    store_tile(e, c, rb * MR, p * NR);
            }
        }
    }
    return threads;
}

/* a [m, k] (rows a_stride apart), packed [ceil(n / NR), k, NR] -> out [m, n] = a @ W.T.
 * Returns 0, or -1 when it cannot allocate its buffer. */
int panel_linear(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                 int64_t n, float *out) {
    float *at = alloc_rows(m, k);
    if (!at) return -1;
    const epilogue e = {m, n, out, NULL, NULL, 0};
    for_each_tile(a, a_stride, at, m, k, packed, &e, 0);
    free(at);
    return 0;
}

/* a [m, k] (rows a_stride apart), packed [ceil(n / NR), k, NR] -> out[m] the first argmax of each
 * row of a @ W.T over n columns. Returns 0, or -1 when it cannot allocate its buffers. */
int greedy_head(const float *a, int64_t m, int64_t k, int64_t a_stride, const float *packed,
                int64_t n, int64_t *out) {
    int max_threads = 1;
#ifdef _OPENMP
    max_threads = omp_get_max_threads();
#endif
    const int64_t state = (m + MR - 1) / MR * MR * NR; /* one thread's best values (and columns) */
    float *at = alloc_rows(m, k);
    float *best = alloc64(sizeof(float) * max_threads * state);
    int32_t *where = alloc64(sizeof(int32_t) * max_threads * state);
    if (!at || !best || !where) {
        free(at), free(best), free(where);
        return -1;
    }
    for (int64_t i = 0; i < max_threads * state; i++) best[i] = -__builtin_inff(), where[i] = 0;
    const epilogue e = {m, n, NULL, best, where, state};
    const int threads = for_each_tile(a, a_stride, at, m, k, packed, &e, 1);
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
