/* The loop over a product's tiles (cpu_panel.h), included once by each panel file after it has
 * defined the three functions that differ between fp32, bf16, int8 and bf16 weights, so that they
 * are inlined:
 *
 *   static void block_rows(const void *a, int64_t m, int64_t k, int64_t a_stride, int64_t rb,
 *                          void *at);
 *       row block rb of a (rows a_stride elements apart) -> its [steps][MR] copy in at;
 *   static inline int64_t panel_bytes(int64_t k);
 *       the bytes of one panel of a weight with k columns (panels lie that far apart);
 *   static inline void tile(const void *at, const void *panel, int64_t steps, int rows,
 *                           const char *prefetch, int64_t prefetch_lines, vf c[MR][NRV]);
 *       c = one MR x NR tile of products over `steps`, of which the first `rows` (1 .. MR) are
 *       rows of a (a kernel may skip the others: their products are never stored nor chosen);
 *       meanwhile prefetches `prefetch_lines` cache lines from `prefetch` (a slice of the next
 *       panel) into L2.
 *
 * No include guard: each including file gets its own static copy.
 */
/* Every tile of a @ W.T, each thread a contiguous range of panels, after the threads have
 * copied a's row blocks into at (alloc_rows) together; returns the threads used. */
static int for_each_tile(const void *a, int64_t a_stride, void *at, int64_t m, int64_t k,
                         int64_t steps, const void *packed, const epilogue *e, int greedy) {
    const int64_t row_blocks = (m + MR - 1) / MR, panels = (e->n + NR - 1) / NR;
    const int64_t panel_size = panel_bytes(k), lines_per_panel = panel_size / 64;
    const int64_t block_bytes = 4 * steps * MR;
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
            const char *panel = (const char *)packed + p * panel_size;
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                const int64_t l0 = lines_per_panel * rb / row_blocks;
                const int64_t l1 = lines_per_panel * (rb + 1) / row_blocks;
                const int rows = m - rb * MR < MR ? (int)(m - rb * MR) : MR;
                tile((const char *)at + rb * block_bytes, panel, steps, rows,
                     panel + panel_size + l0 * 64, p + 1 < end ? l1 - l0 : 0, c);
                if (greedy)
                    fold_tile(e, t, c, rb * MR, p * NR);
                else
                    store_tile(e, c, rb * MR, p * NR);
            }
        }
    }
    return threads;
}

/* out[m] = the first argmax of each row of a @ W.T over n columns (the loop above, folding).
 * Returns 0, or -1 when it cannot allocate its buffers. */
static int greedy_tiles(const void *a, int64_t m, int64_t k, int64_t steps, int64_t a_stride,
                        const void *packed, int64_t n, int64_t *out) {
    int max_threads = 1;
#ifdef _OPENMP
    max_threads = omp_get_max_threads();
#endif
    const int64_t state = (m + MR - 1) / MR * MR * NR; /* one thread's best values (and columns) */
    void *at = alloc_rows(m, steps);
    float *best = alloc64(sizeof(float) * max_threads * state);
    int32_t *where = alloc64(sizeof(int32_t) * max_threads * state);
    if (!at || !best || !where) {
        free(at), free(best), free(where);
        return -1;
    }
    for (int64_t i = 0; i < max_threads * state; i++) best[i] = -__builtin_inff(), where[i] = 0;
    const epilogue e = {m, n, NULL, NULL, best, where, state};
    const int threads = for_each_tile(a, a_stride, at, m, k, steps, packed, &e, 1);
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
