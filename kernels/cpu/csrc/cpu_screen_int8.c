/* Greedy tokens from an int8 screen of the LM head on AMX (kernels/cpu/screened_head_int8.py):
 * the products of int8 copies of the rows and the weight, exact in int32 on the tile unit, bound
 * every column's fp32 logit; the columns that can still be a row's maximum are computed exactly
 * (cpu_screen.c's first_max_exact), and the first maximum among them is greedy_head's token.
 *
 * Setup (Python, once): column j of the weight w_j (a row of [n, k]) has a scale s_j, int8 values
 * q_j (w~_j = s_j q_j), r_j >= |w_j - w~_j| and m_j >= |w~_j| (2-norms, rounded up). A row a gets
 * its own here: t = max |a_i| / 127, qa = round(a / t), A >= |a|, E >= |a - t qa|. With P_j the
 * integer product qa . q_j, a . w_j - t s_j P_j = a . (w_j - w~_j) + (a - t qa) . w~_j, so
 *
 *     |e_j - t s_j P_j| <= A r_j + E m_j + g A (r_j + m_j)
 *
 * where e_j is the exact head's fp32 logit (an FMA chain of k terms: within g = k 2^-24 / (1 -
 * k 2^-24) of sum |a_i w_ij| <= A |w_j|). The screen works in units of t: z_j = fl(fl(P_j) s_j)
 * (within 2.01 2^-24 |P_j s_j| of P_j s_j, and |P_j s_j| <= (A + E) m_j / t) and
 *
 *     b_j = alpha r_j + beta m_j,  alpha = A (1 + g) / t,  beta = (E + g A + 2.01 2^-24 (A + E)) / t
 *
 * (alpha, beta rounded up by 2^-20, which covers b_j's own fp32 rounding), so e_j / t lies in
 * [z_j - b_j, z_j + b_j]. Every column whose upper end reaches the largest lower end, less
 * delta = 2^-20 (max |z| + max b) for the rounding of z +- b and of that difference, is a
 * candidate. A row goes to the exact head (-1) when a value is not finite, when max |a_i| is
 * outside [2^-60, 2^60] or (A + E)(max r + max m) > 2^100 (so nothing here is subnormal or
 * overflows), or when more than CAP - CHUNK * COLS candidates stay at once.
 *
 * The pass over the weight is split by columns between the threads (each reads its share once
 * for up to GROUP_ROWS rows), each keeping a running threshold and candidate list a row; the
 * lists are then merged in column order, so ties go to the first column.
 */
#define _GNU_SOURCE /* syscall */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_attention.h" /* hmax */
#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && VW == 16 && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define COLS 16        /* columns of a weight block: one tile's width in int32 */
#define KTILE 64       /* int8 products along k in one tile row */
#define GROUP_ROWS 64  /* rows one pass over the weight serves: 4 tiles of 16 */
#define CHUNK 4        /* blocks screened together */
#define CAP 256        /* candidates a thread keeps for a row */
#define PREFETCH_AHEAD 2 /* chunks between the one a thread reads and the one it prefetches */

/* 1 where this build has the AMX kernel and Linux grants this process the tile state. */
int64_t int8_screen_available(void) {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

typedef struct {
    float alpha, beta, delta;
    int failed;
} RowBound;

/* Row a -> qa [kpad] (zero past k) and its bound's factors (see above), or failed. */
static void quantize_row(const float *a, int64_t k, int64_t kpad, int8_t *qa, double m_max,
                         double r_max, RowBound *rb) {
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < k; i++) {
        finite &= isfinite(a[i]) != 0;
        amax = fabsf(a[i]) > amax ? fabsf(a[i]) : amax;
    }
    for (int64_t i = 0; i < kpad; i++) qa[i] = 0;
    rb->failed = !finite || amax < 0x1p-60f || amax > 0x1p60f;
    if (rb->failed) return;
    const float t = amax / 127.0f;
    double a2 = 0.0, e2 = 0.0;
    for (int64_t i = 0; i < k; i++) {
        float q = nearbyintf(a[i] / t);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        qa[i] = (int8_t)q;
        const double e = (double)a[i] - (double)t * (double)q; /* exact in double */
        a2 += (double)a[i] * (double)a[i];
        e2 += e * e;
    }
    const double A = sqrt(a2) * (1.0 + 1e-9), E = sqrt(e2) * (1.0 + 1e-9), u = 0x1p-24;
    const double g = (double)k * u / (1.0 - (double)k * u);
    const double alpha = A * (1.0 + g) / t, beta = (E + g * A + 2.01 * u * (A + E)) / t;
    const double z_max = (1.0 + 4.0 * u) * (A + E) * m_max / t;
    const double b_max = alpha * r_max + beta * m_max;
    if ((A + E) * (r_max + m_max) > 0x1p100) {
        rb->failed = 1;
        return;
    }
    rb->alpha = (float)(alpha * (1.0 + 0x1p-20));
    rb->beta = (float)(beta * (1.0 + 0x1p-20));
    rb->delta = (float)(0x1p-20 * (z_max + b_max));
}

typedef struct {
    int32_t *cols;  /* [GROUP_ROWS][CAP] */
    float *ups;     /* [GROUP_ROWS][CAP] */
    int *count;     /* [GROUP_ROWS], -1 once the row overflowed */
    float *low;     /* [GROUP_ROWS]: the running largest lower end */
} Candidates;

/* Keep the row's candidates whose upper end reaches thr; whether there is room for a chunk. */
static int compact(Candidates *c, int64_t r, float thr) {
    int32_t *cols = c->cols + r * CAP;
    float *ups = c->ups + r * CAP;
    int kept = 0;
    for (int i = 0; i < c->count[r]; i++)
        if (ups[i] >= thr) cols[kept] = cols[i], ups[kept] = ups[i], kept++;
    c->count[r] = kept;
    return kept + CHUNK * COLS <= CAP;
}

/* Lines of weight a thread prefetches to L2 while it works on the chunk before them: `per_step`
 * at each product and each screened row, so the memory stream keeps going under both. */
typedef struct {
    const char *at;
    int64_t lines, next, per_step;
} Prefetch;

INLINE void prefetch_some(Prefetch *f) {
    for (int64_t x = 0; x < f->per_step && f->next < f->lines; x++, f->next++)
        _mm_prefetch(f->at + f->next * 64, _MM_HINT_T1);
}

/* Screen the nb blocks of int32 products in p ([CHUNK][GROUP_ROWS][COLS]) starting at column
 * j0 for rows [0, rows): update each row's running threshold, add the candidates. A row whose
 * largest z plus the chunk's largest b (the same fp32 operations on larger operands, so no
 * smaller than any column's z_j + b_j) is below its threshold has nothing here: the common
 * case, once the threshold has risen, costs no bounds. */
static void screen_chunk(const int32_t *p, int nb, int64_t j0, int64_t n, int64_t rows,
                         const RowBound *rb, const float *scale, const float *res,
                         const float *norm, Candidates *c, Prefetch *ahead) {
    vf s[CHUNK], rr[CHUNK], mm[CHUNK];
    vi valid[CHUNK];
    const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vf neg_inf = splat(-INFINITY);
    vf r_top = splat(0.0f), m_top = r_top;
    for (int b = 0; b < nb; b++) {
        const int64_t left = n - (j0 + b * COLS);
        valid[b] = iota < (vi){0} + (int32_t)(left < COLS ? left : COLS);
        s[b] = load(scale + j0 + b * COLS);
        rr[b] = load(res + j0 + b * COLS);
        mm[b] = load(norm + j0 + b * COLS);
        r_top = vmax(r_top, rr[b]), m_top = vmax(m_top, mm[b]); /* 0 past n */
    }
    const float r_max = hmax(r_top), m_max = hmax(m_top);
    const int tail = j0 + nb * COLS > n;
    for (int64_t r = 0; r < rows; r++) {
        prefetch_some(ahead);
        if (rb[r].failed || c->count[r] < 0) continue;
        vf z[CHUNK], z_top = neg_inf;
        for (int b = 0; b < nb; b++) {
            const vi pv = *(const vi *)(p + (b * GROUP_ROWS + r) * COLS);
            z[b] = __builtin_convertvector(pv, vf) * s[b];
            z_top = vmax(z_top, tail ? vselect(valid[b], z[b], neg_inf) : z[b]);
        }
        const float b_max = fmaf(rb[r].alpha, r_max, rb[r].beta * m_max);
        if (!any_lane(z_top + splat(b_max) >= splat(c->low[r] - rb[r].delta))) continue;
        const vf alpha = splat(rb[r].alpha), beta = splat(rb[r].beta);
        vf up[CHUNK], lows = neg_inf;
        for (int b = 0; b < nb; b++) {
            const vf bound = fmadd(alpha, rr[b], beta * mm[b]);
            up[b] = vselect(valid[b], z[b] + bound, neg_inf);
            lows = vmax(lows, vselect(valid[b], z[b] - bound, neg_inf));
        }
        const float low = hmax(lows);
        if (low > c->low[r]) c->low[r] = low;
        const float thr = c->low[r] - rb[r].delta;
        const vf t = splat(thr);
        if (c->count[r] + nb * COLS > CAP && !compact(c, r, thr)) {
            c->count[r] = -1;
            continue;
        }
        int32_t *cols = c->cols + r * CAP;
        float *ups = c->ups + r * CAP;
        for (int b = 0; b < nb; b++) {
            const vi keep = up[b] >= t;
            if (!any_lane(keep)) continue;
            for (int l = 0; l < COLS; l++)
                if (keep[l]) {
                    cols[c->count[r]] = (int32_t)(j0 + b * COLS + l);
                    ups[c->count[r]++] = up[b][l];
                }
        }
    }
}

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* C tile b (0-3) += A (tile AT: 4 or 5, alternate k steps) x the weight's tile at w (tile BT:
 * 6 or 7, alternate blocks), so a load need not wait on the product that reads the tile before
 * it. */
#define PRODUCT(b, AT, BT)                   \
    case (b) * 4 + ((AT) - 4) * 2 + (BT) - 6: \
        _tile_loadd(BT, w, KTILE);           \
        _tile_dpbssd(b, AT, BT);             \
        break;

/* Products of qa's row tiles with weight blocks [b0, b1) into p, screened CHUNK blocks at a
 * time. For each row tile, its A tile of each k step serves the chunk's blocks (C tiles 0-3). */
static void pass_blocks(const int8_t *qa, int64_t kpad, int tiles, const int8_t *packed,
                        int64_t b0, int64_t b1, int64_t n, int64_t rows, const RowBound *rb,
                        const float *scale, const float *res, const float *norm, int32_t *p,
                        Candidates *c) {
    const int64_t kt_count = kpad / KTILE, block_bytes = COLS * kpad;
    for (int64_t cb = b0; cb < b1; cb += CHUNK) {
        const int nb = b1 - cb < CHUNK ? (int)(b1 - cb) : CHUNK;
        const int8_t *chunk = packed + cb * block_bytes;
        /* the chunk PREFETCH_AHEAD chunks on, over this chunk's products and screened rows */
        const int64_t ahead = cb + PREFETCH_AHEAD * CHUNK;
        const int64_t ahead_blocks = ahead >= b1 ? 0 : b1 - ahead < CHUNK ? b1 - ahead : CHUNK;
        const int64_t lines = ahead_blocks * block_bytes / 64, steps = tiles * kt_count * nb + rows;
        Prefetch prefetch = {(const char *)(packed + ahead * block_bytes), lines, 0,
                             (lines + steps - 1) / steps};
        for (int rt = 0; rt < tiles; rt++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kt = 0; kt < kt_count; kt++) {
                const int a_tile = (int)(kt & 1);
                if (a_tile)
                    _tile_loadd(5, qa + rt * 16 * kpad + kt * KTILE, kpad);
                else
                    _tile_loadd(4, qa + rt * 16 * kpad + kt * KTILE, kpad);
                for (int b = 0; b < nb; b++) {
                    const int8_t *w = chunk + b * block_bytes + kt * COLS * KTILE;
                    prefetch_some(&prefetch);
                    switch (b * 4 + a_tile * 2 + (b & 1)) {
                        PRODUCT(0, 4, 6) PRODUCT(0, 4, 7) PRODUCT(0, 5, 6) PRODUCT(0, 5, 7)
                        PRODUCT(1, 4, 6) PRODUCT(1, 4, 7) PRODUCT(1, 5, 6) PRODUCT(1, 5, 7)
                        PRODUCT(2, 4, 6) PRODUCT(2, 4, 7) PRODUCT(2, 5, 6) PRODUCT(2, 5, 7)
                        PRODUCT(3, 4, 6) PRODUCT(3, 4, 7) PRODUCT(3, 5, 6) PRODUCT(3, 5, 7)
                    }
                }
            }
            int32_t *out = p + rt * 16 * COLS;
            _tile_stored(0, out, COLS * 4);
            if (nb > 1) _tile_stored(1, out + GROUP_ROWS * COLS, COLS * 4);
            if (nb > 2) _tile_stored(2, out + 2 * GROUP_ROWS * COLS, COLS * 4);
            if (nb > 3) _tile_stored(3, out + 3 * GROUP_ROWS * COLS, COLS * 4);
        }
        screen_chunk(p, nb, cb * COLS, n, rows, rb, scale, res, norm, c, &prefetch);
    }
}
#endif

/* The first maximum of the exact logits over the row's candidates of every thread whose upper
 * end reaches the final threshold (cpu_screen.c's first_max_exact: the threads' column ranges
 * are in order, so the list is); -1 when the row failed. */
static int64_t settle_row(const float *a, int64_t k, const float *weight, int64_t w_row,
                          int64_t w_col, const Candidates *all, int threads, int64_t r,
                          const RowBound *rb) {
    if (rb->failed) return -1;
    float low = -INFINITY;
    for (int t = 0; t < threads; t++) {
        if (all[t].count[r] < 0) return -1;
        low = all[t].low[r] > low ? all[t].low[r] : low;
    }
    const float thr = low - rb->delta;
    int64_t cols[threads * CAP], count = 0;
    for (int t = 0; t < threads; t++)
        for (int i = 0; i < all[t].count[r]; i++)
            if (all[t].ups[r * CAP + i] >= thr) cols[count++] = all[t].cols[r * CAP + i];
    return first_max_exact(a, k, weight, w_row, w_col, cols, count);
}

/* a [m, k] fp32 (rows a_stride apart); packed: the int8 weight in blocks of COLS columns, each
 * [kpad / KTILE][KTILE / 4][COLS][4] (the tile unit's B layout), kpad a multiple of KTILE;
 * scale, res, norm [>= n rounded up to COLS]: s_j, r_j, m_j (above), r_max and m_max their
 * largest; weight [n, k] fp32 (element (j, i) at weight[j * w_row + i * w_col]) for the exact
 * logits -> out[m] tokens or -1 (the caller runs the exact head); returns how many rows got -1,
 * or -2 where this build or process has no AMX (nothing written). */
int64_t int8_screened_argmax(const float *a, int64_t m, int64_t k, int64_t a_stride,
                             const int8_t *packed, int64_t n, int64_t kpad, const float *scale,
                             const float *res, const float *norm, float r_max, float m_max,
                             const float *weight, int64_t w_row, int64_t w_col, int64_t *out) {
#ifdef HAVE_AMX
    const int threads = omp_get_max_threads();
    const int64_t blocks = (n + COLS - 1) / COLS;
    int8_t *qa = aligned_alloc(64, GROUP_ROWS * kpad);
    RowBound *rb = malloc(sizeof(RowBound) * GROUP_ROWS);
    Candidates *all = malloc(sizeof(Candidates) * threads);
    char *lists = malloc((size_t)threads * GROUP_ROWS * (CAP * 8 + 8));
    int32_t *products = aligned_alloc(64, (size_t)threads * CHUNK * GROUP_ROWS * COLS * 4);
    if (!qa || !rb || !all || !lists || !products) {
        free(qa), free(rb), free(all), free(lists), free(products);
        for (int64_t r = 0; r < m; r++) out[r] = -1;
        return m;
    }
    for (int t = 0; t < threads; t++) {
        char *base = lists + (size_t)t * GROUP_ROWS * (CAP * 8 + 8);
        all[t].cols = (int32_t *)base;
        all[t].ups = (float *)(base + GROUP_ROWS * CAP * 4);
        all[t].count = (int *)(base + GROUP_ROWS * CAP * 8);
        all[t].low = (float *)(base + GROUP_ROWS * CAP * 8 + GROUP_ROWS * 4);
    }
    int64_t unsettled = 0;
    for (int64_t g0 = 0; g0 < m; g0 += GROUP_ROWS) {
        const int64_t rows = m - g0 < GROUP_ROWS ? m - g0 : GROUP_ROWS;
        const int tiles = (int)((rows + 15) / 16);
#pragma omp parallel num_threads(threads) reduction(+ : unsettled)
        {
            const int t = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp for schedule(static)
            for (int64_t r = 0; r < GROUP_ROWS; r++) {
                if (r < rows)
                    quantize_row(a + (g0 + r) * a_stride, k, kpad, qa + r * kpad, m_max, r_max,
                                 rb + r);
                else
                    for (int64_t i = 0; i < kpad; i++) qa[r * kpad + i] = 0;
            }
            Candidates *c = all + t;
            for (int64_t r = 0; r < rows; r++) c->count[r] = 0, c->low[r] = -INFINITY;
            TileConfig config = {.palette = 1};
            for (int x = 0; x < 8; x++) config.colsb[x] = 64, config.rows[x] = 16;
            _tile_loadconfig(&config);
            pass_blocks(qa, kpad, tiles, packed, blocks * t / team, blocks * (t + 1) / team, n,
                        rows, rb, scale, res, norm, products + t * CHUNK * GROUP_ROWS * COLS,
                        c);
            _tile_release();
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                out[g0 + r] = settle_row(a + (g0 + r) * a_stride, k, weight, w_row, w_col, all,
                                         team, r, rb + r);
                unsettled += out[g0 + r] < 0;
            }
        }
    }
    free(qa), free(rb), free(all), free(lists), free(products);
    return unsettled;
#else
    (void)a, (void)m, (void)k, (void)a_stride, (void)packed, (void)n, (void)kpad, (void)scale;
    (void)res, (void)norm, (void)r_max, (void)m_max, (void)weight, (void)w_row, (void)w_col;
    (void)out;
    return -2;
#endif
}
