/* Greedy sampling's argmax over each row of fp32 logits on CPU: the index of the first maximum,
 * as torch's max(dim=-1).indices. One pass over the logits (read once, from memory: a step's
 * logits are rows x vocab floats, megabytes), rows shared out by OpenMP.
 *
 * Each row is scanned VW lanes at a time: lane l keeps the best value it has seen and the first
 * column holding it (a later column replaces it only when strictly greater); the lanes are then
 * combined, ties going to the smaller column. NaN is not expected (logits are finite or -inf).
 */
#include <stdint.h>

#include "cpu_vec.h"

static int64_t row_argmax(const float *x, int64_t cols) {
    int64_t c = 0;
    int64_t best_col = 0;
    float best = x[0];
    if (cols >= VW) {
        vf value = load(x);
        vi column = {0}, step = {0};
        for (int l = 0; l < VW; l++) column[l] = l, step[l] = VW;
        vi where = column;
        for (c = VW; c + VW <= cols; c += VW) {
            column += step;
            const vf v = load(x + c);
            const vi greater = v > value;
            value = vselect(greater, v, value);
            where = (greater & column) | (~greater & where);
        }
        best = value[0];
        best_col = where[0];
        for (int l = 1; l < VW; l++)
            if (value[l] > best || (value[l] == best && where[l] < best_col))
                best = value[l], best_col = where[l];
    }
    for (; c < cols; c++)
        if (x[c] > best) best = x[c], best_col = c;
    return best_col;
}

void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * row_stride, cols);
}
