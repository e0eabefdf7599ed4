/* The decoder's elementwise steps on CPU, fp32, fused so that each reads and writes its rows once
 * (torch runs them as one pass per op: five for an RMSNorm, more with its residual add):
 *
 *   rms_norm:  s = x + residual (when residual is given; s is written back to residual_out),
 *              out = weight * (s * 1 / sqrt(mean(s^2) + eps))  -- Hugging Face's LlamaRMSNorm
 *   silu_mul:  out = silu(gate) * up, gate_up's rows = [gate | up]  -- LlamaMLP's activation
 *   rope:      out = x * cos + rotate(x) * sin over each head's D values, rotate swapping the
 *              two halves (sin's first half holds -sin: the tables' layout), each product and
 *              the sum rounded on their own, as torch's x * cos then addcmul
 *
 * Rows may be strided (row_stride, in floats); columns are contiguous. Rows are shared out by
 * OpenMP (the libgomp torch uses; see cpu_decode.c).
 */
#include <math.h>
#include <stdint.h>

#include "cpu_vec.h"

void rms_norm(const float *x, int64_t x_stride, const float *residual, const float *weight,
              float eps, int64_t rows, int64_t dim, float *out, float *residual_out) {
#pragma omp parallel for schedule(static) if (rows * dim >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        const float *s = xr;
        if (residual != 0) {
            float *sr = residual_out + r * dim;
            const float *rr = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) sr[i] = xr[i] + rr[i];
            s = sr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += s[i] * s[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (s[i] * inv);
    }
}

/* silu(g) = g * sigmoid(g), sigmoid through e = exp(-|g|) <= 1 (never overflows):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below. */
INLINE float silu(float g) {
    const float e = expf(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        const vf zero = splat(0.0f), one = splat(1.0f);
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            const vf gv = load(g + i);
            const vi negative = gv < zero;
            const vf e = vexp(vselect(negative, gv, -gv));
            const vf sigmoid = vselect(negative, e, one) / (one + e);
            store(o + i, gv * sigmoid * load(u + i));
        }
        for (; i < inter; i++) o[i] = silu(g[i]) * u[i];
    }
}

void rope(const float *x, int64_t token_stride, int64_t head_stride, int64_t tokens,
          int64_t heads, int64_t dim, const float *cos, const float *sin, float *out) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * token_stride + h * head_stride;
            float *o = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) o[i] = xi[i] * c[i] + xi[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) o[i] = xi[i] * c[i] + xi[i - half] * s[i];
        }
    }
}
