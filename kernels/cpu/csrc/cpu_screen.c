/* Greedy sampling's argmax from screened logits (kernels/cpu/screened_head.py): each row of approx
 * holds bf16 logits from a cheap product, each within bound_j = scale_r * col_norms[j] of the
 * fp32 logit the exact head computes (the caller proves the bound). Every column whose exact
 * logit can still be the row's maximum is a candidate:
 *
 *     approx_j + bound_j >= max over i of (approx_i - bound_i)
 *
 * (the exact maximum is at least the right side, a column below it on the left is below the
 * maximum). The candidates' logits are then computed exactly, as the FMA chain over the hidden
 * size from +0 in order that each lane of cpu_panel_gemm.c's tile computes, so the first maximum
 * among them (ties to the smaller column) is greedy_head's token to the bit.
 *
 * bound_j also takes in what bf16 hardware flushes to zero (subnormals, at most 2^-126 a value).
 * A row gets -1 instead (the caller runs the exact head on it) when its hidden state or an
 * approx logit is not finite, or when more than MAX_CANDIDATES columns survive.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_attention.h" /* hmax */
#include "cpu_kernels.h"
#include "cpu_vec.h"

#define MAX_CANDIDATES 512

/* One step of a lane's chain as cpu_vec.h's fmadd computes it: fused where the target has FMA. */
INLINE float fmadd1(float a, float b, float c) {
#if VW == 16 || (VW == 8 && defined(__FMA__))
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* Exact logits of up to CHAINS columns at once (independent FMA chains, so their latencies
 * overlap): each the FMA chain over i from +0 in order, as a lane of the panel GEMM's tile. */
#define CHAINS 8
static void exact_logits(const float *a, int64_t k, const float *weight, int64_t w_row,
                         int64_t w_col, const int64_t *cols, int count, float *out) {
    float acc[CHAINS] = {0};
    const float *w[CHAINS];
    for (int c = 0; c < count; c++) w[c] = weight + cols[c] * w_row;
    for (int64_t i = 0; i < k; i++)
        for (int c = 0; c < count; c++) acc[c] = fmadd1(a[i], w[c][i * w_col], acc[c]);
    for (int c = 0; c < count; c++) out[c] = acc[c];
}

/* The first maximum of the exact logits of the candidate columns cols[0..count) (in column
 * order, so ties go to the smaller column): greedy_head's token when the maximum is among them;
 * -1 when there are none. */
int64_t first_max_exact(const float *a, int64_t k, const float *weight, int64_t w_row,
                        int64_t w_col, const int64_t *cols, int64_t count) {
    int64_t best_col = -1;
    float best = -INFINITY;
    for (int64_t i0 = 0; i0 < count; i0 += CHAINS) {
        const int group = count - i0 < CHAINS ? (int)(count - i0) : CHAINS;
        float logits[CHAINS];
        exact_logits(a, k, weight, w_row, w_col, cols + i0, group, logits);
        for (int i = 0; i < group; i++)
            if (best_col < 0 || logits[i] > best) best = logits[i], best_col = cols[i0 + i];
    }
    return best_col;
}

#define BLOCK (16 * VW) /* columns whose largest upper bound pass 1 keeps for pass 2 */

/* One row: its token, or -1 (see above). Pass 1 finds the threshold (the largest lower bound)
 * and each block's largest upper bound; pass 2 looks for candidates only in the blocks that
 * reach the threshold (a handful of the row's). */
static int64_t screen_row(const float *a, int64_t k, const uint16_t *y, int64_t n,
                          const float *weight, int64_t w_row, int64_t w_col,
                          const float *col_norms, float c) {
    double squares[4] = {0.0, 0.0, 0.0, 0.0}, largest = 0.0;
    for (int64_t i = 0; i < k; i++) {
        const double x = a[i];
        squares[i % 4] += x * x;
        largest = fabs(x) > largest ? fabs(x) : largest;
    }
    const double norm = sqrt(squares[0] + squares[1] + squares[2] + squares[3]);
    /* rounded up: the bound may only grow */
    const float scale = (float)(norm * (1.0 + 1e-6)) * c;
    /* bf16 hardware flushes subnormal inputs, products and sums to zero: at most 2^-126 each */
    const float flushed = (float)(k + 1) * 0x1p-126f * (float)(largest * 1.01 + 2.0);
    if (!isfinite(scale)) return -1;
    const vf s = splat(scale);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    float block_high[blocks];
    vf low = splat(-INFINITY), finite = splat(0.0f);
    float highest_low = -INFINITY;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < n ? j0 + BLOCK : n;
        const int64_t jv = j1 - (j1 - j0) % VW;
        vf high0 = splat(-INFINITY), high1 = high0, low1 = low; /* two chains: latency */
        int64_t j = j0;
        for (; j + 2 * VW <= jv; j += 2 * VW) {
            const vf y0 = load_bf16(y + j), y1 = load_bf16(y + j + VW);
            const vf b0 = s * load(col_norms + j), b1 = s * load(col_norms + j + VW);
            low = vmax(low, y0 - b0), low1 = vmax(low1, y1 - b1);
            high0 = vmax(high0, y0 + b0), high1 = vmax(high1, y1 + b1);
            finite += (y0 - y0) + (y1 - y1); /* NaN from then on when a value is inf or NaN */
        }
        for (; j < jv; j += VW) {
            const vf y0 = load_bf16(y + j), b0 = s * load(col_norms + j);
            low = vmax(low, y0 - b0), high0 = vmax(high0, y0 + b0);
            finite += y0 - y0;
        }
        low = vmax(low, low1);
        float high = hmax(vmax(high0, high1));
        for (; j < j1; j++) {
            const float yj = bf16_to_float(y[j]), bj = scale * col_norms[j];
            if (!isfinite(yj)) return -1;
            if (yj - bj > highest_low) highest_low = yj - bj;
            if (yj + bj > high) high = yj + bj;
        }
        block_high[b] = high;
    }
    for (int l = 0; l < VW; l++) {
        if (finite[l] != 0.0f) return -1;
        if (low[l] > highest_low) highest_low = low[l];
    }
    const float threshold = highest_low - 2.0f * flushed; /* both sides' flushing */
    int64_t candidates[MAX_CANDIDATES];
    int count = 0;
    const vf t = splat(threshold);
    for (int64_t b = 0; b < blocks; b++) {
        if (block_high[b] < threshold) continue;
        const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < n ? j0 + BLOCK : n;
        const int64_t jv = j1 - (j1 - j0) % VW;
        int64_t j = j0;
        for (; j < jv; j += VW) {
            const vi keep = load_bf16(y + j) + s * load(col_norms + j) >= t;
            if (!any_lane(keep)) continue;
            for (int l = 0; l < VW; l++)
                if (keep[l]) {
                    if (count == MAX_CANDIDATES) return -1;
                    candidates[count++] = j + l;
                }
        }
        for (; j < j1; j++)
            if (bf16_to_float(y[j]) + scale * col_norms[j] >= threshold) {
                if (count == MAX_CANDIDATES) return -1;
                candidates[count++] = j;
            }
    }
    return first_max_exact(a, k, weight, w_row, w_col, candidates, count);
}

/* a [m, k] fp32 (rows a_stride apart), approx [m, n] bf16 bits, weight [n, k] fp32 (element
 * (j, i) at weight[j * w_row + i * w_col]: any layout), col_norms [n] (each >= its weight row's
 * 2-norm), c the bound's factor -> out[m] tokens or -1; returns how many rows got -1. */
int64_t screened_argmax(const float *a, int64_t m, int64_t k, int64_t a_stride,
                        const uint16_t *approx, int64_t n, const float *weight, int64_t w_row,
                        int64_t w_col, const float *col_norms, float c, int64_t *out) {
    int64_t unsettled = 0;
#pragma omp parallel for schedule(static) if (m > 1) reduction(+ : unsettled)
    for (int64_t r = 0; r < m; r++) {
        out[r] = screen_row(a + r * a_stride, k, approx + r * n, n, weight, w_row, w_col,
                            col_norms, c);
        unsettled += out[r] < 0;
    }
    return unsettled;
}
