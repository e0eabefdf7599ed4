/* cpu_elementwise.c's steps for bf16 tensors: each reads and writes its rows once, computes in
 * fp32 and rounds to bf16 (to nearest even) exactly where kernels/elementwise.py's torch
 * functions do in bf16, so that the results are torch's to the bit:
 *
 *   rms_norm:  s = bf16(x + residual) (written to residual_out; s = x without a residual),
 *              h = bf16(s * 1 / sqrt(sum(s^2) / dim + eps)), out = bf16(weight * h); the sum of
 *              squares in torch's own order (torch_square_sum), as h.pow(2).mean(-1) sums them
 *   silu_mul:  out = bf16(bf16(gate / (1 + exp(-gate))) * up), as F.silu(gate) * up; exp is
 *              Cephes' polynomial where torch's is Sleef's (glibc's in its tails): they may
 *              differ in fp32, but bf16(silu(g)) takes only 65536 values of g, and for every
 *              one it is torch's (tests/test_cpu_elementwise_bf16.py tries them all)
 *   rope:      out = bf16(bf16(x * cos) + bf16(rotate(x) * sin)), as x * cos + x.roll() * sin
 *
 * bf16 values are their bits (uint16_t). Rows may be strided (in elements); columns are
 * contiguous. Rows are shared out by OpenMP, as in cpu_elementwise.c. The conversions are shifts
 * and integer adds (cpu_vec.h's load_bf16, to_bf16 below), so no AVX512-BF16 is needed.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_vec.h"

typedef uint16_t bf16;

/* fp32 -> bf16 rounded to nearest even, as torch rounds, by integer adds and shifts; kept in
 * fp32 (rounded) or as bits (to_bf16). No NaN check: every NaN met here has the low 16 bits of
 * its mantissa clear (a bf16 input's, widened, or the default NaN arithmetic makes), so the
 * rounding add never carries out of them and a NaN stays a NaN (its bits may be other than
 * torch's, which are not its own either: 0x7fc0 in its scalar code, 0xffff in its vectors). */
INLINE vu rounding(vf x) {
    const vu u = (vu)x;
    return u + 0x7fffu + ((u >> 16) & 1u);
}
INLINE vf rounded(vf x) { return (vf)(rounding(x) & 0xffff0000u); }
INLINE vh to_bf16(vf x) { return __builtin_convertvector(rounding(x) >> 16, vh); }
INLINE float rounded1(float x) { return rounded(splat(x))[0]; }
INLINE bf16 bits1(float x) { return to_bf16(splat(x))[0]; }
INLINE void store_bf16(bf16 *p, vf x) { *(vh_mem *)p = to_bf16(x); }
INLINE float sq(bf16 x) {
    const float f = bf16_to_float(x);
    return f * f;
}

static int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(x - 1); }

/* How many floats torch's float sum adds as one vector: its CPU kernel for sums has no AVX-512
 * variant, so on an AVX-512 CPU too it runs its AVX2 one, of 8 floats (as its generic one). */
#define TORCH_SUM_LANES 8

/* SumKernel.cpp's row_sum: the sum of n items, item i being the squares of s[i*w, i*w + w) (w
 * lanes, summed lane by lane into sum[w]). Items 4j + k go to accumulator k (k < 4); each
 * accumulator is a cascade of four levels, the first flushed into the next every 2^power items
 * and so on up; then the items past the last four go into accumulator 0 and the other three
 * are added to it in order. w is a constant where this is inlined (1 or TORCH_SUM_LANES). */
INLINE void row_square_sum(const bf16 *s, int64_t n, const int w, float *sum) {
    float acc[4][4][TORCH_SUM_LANES] = {{{0}}}; /* [level][accumulator][lane] */
    const int64_t groups = n / 4;
    const int64_t power = ceil_log2(groups) / 4 > 4 ? ceil_log2(groups) / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    for (; i + step <= groups;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) acc[0][k][l] += sq(s[(4 * i + k) * w + l]);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < w; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < groups; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += sq(s[(4 * i + k) * w + l]);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < w; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t item = 4 * groups; item < n; item++)
        for (int l = 0; l < w; l++) acc[0][0][l] += sq(s[item * w + l]);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < w; l++) acc[0][0][l] += acc[0][k][l];
    for (int l = 0; l < w; l++) sum[l] = acc[0][0][l];
}

/* The sum of s[i]^2 over a row of `dim`, rounded as torch's float sum (SumKernel.cpp's
 * cascade_sum over a contiguous row) rounds it: rows of at least a vector as row_sum over
 * vectors, then 0 + the elements past the last vector + the lanes in order; shorter rows as
 * row_sum over single elements. Each square is rounded to fp32 on its own, as h.pow(2) stores
 * it; the order of the additions matters: another order moves the odd h by a bf16 ulp. */
static float torch_square_sum(const bf16 *s, int64_t dim) {
    float sum[TORCH_SUM_LANES];
    if (dim < TORCH_SUM_LANES) {
        row_square_sum(s, dim, 1, sum);
        return sum[0];
    }
    const int64_t vectors = dim / TORCH_SUM_LANES;
    row_square_sum(s, vectors, TORCH_SUM_LANES, sum);
    float total = 0.0f;
    for (int64_t i = vectors * TORCH_SUM_LANES; i < dim; i++) total += sq(s[i]);
    for (int l = 0; l < TORCH_SUM_LANES; l++) total += sum[l];
    return total;
}

void rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *weight,
                   float eps, int64_t rows, int64_t dim, bf16 *out, bf16 *residual_out) {
    const int64_t dv = dim - dim % VW;
#pragma omp parallel for schedule(static) if (rows * dim >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *s = x + r * x_stride;
        if (residual != 0) {
            const bf16 *rr = residual + r * dim;
            bf16 *sr = residual_out + r * dim;
            for (int64_t i = 0; i < dv; i += VW)
                store_bf16(sr + i, load_bf16(s + i) + load_bf16(rr + i));
            for (int64_t i = dv; i < dim; i++)
                sr[i] = bits1(bf16_to_float(s[i]) + bf16_to_float(rr[i]));
            s = sr;
        }
        const float inv = 1.0f / sqrtf(torch_square_sum(s, dim) / (float)dim + eps);
        bf16 *o = out + r * dim;
        const vf vinv = splat(inv);
        for (int64_t i = 0; i < dv; i += VW)
            store_bf16(o + i, load_bf16(weight + i) * rounded(load_bf16(s + i) * vinv));
        for (int64_t i = dv; i < dim; i++)
            o[i] = bits1(bf16_to_float(weight[i]) * rounded1(bf16_to_float(s[i]) * inv));
    }
}

/* e^x over all of x for silu's 1 + e^-g: cpu_vec.h's vexp polynomial (in FMAs: fewer
 * instructions, and closer to e^x) on x clamped to [-80, 88.72...]. Below -80 it gives e^-80,
 * which 1 + e^x rounds away (to 1) as it does the true e^x; at the top the product by 2^n
 * overflows to infinity where expf does (x beyond ln(FLT_MAX)), and stays finite below (n up
 * to 128: 2^n in two factors). A NaN x gives a number, which a NaN g turns back into NaN. */
INLINE vf exp_for_silu(vf x) {
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23 */
    x = vmin(vmax(x, splat(-80.0f)), splat(88.72283935546875f));
    const vf t = fmadd(x, splat(1.44269504088896341f), magic);
    const vf n = t - magic;
    const vi ni = (vi)t - (vi)magic;
    x = fmadd(n, splat(2.12194440e-4f), fmadd(n, splat(-0.693359375f), x));
    vf y = splat(1.9875691500e-4f);
    y = fmadd(y, x, splat(1.3981999507e-3f));
    y = fmadd(y, x, splat(8.3334519073e-3f));
    y = fmadd(y, x, splat(4.1665795894e-2f));
    y = fmadd(y, x, splat(1.6666665459e-1f));
    y = fmadd(y, x, splat(5.0000001201e-1f));
    y = fmadd(y, x * x, x + splat(1.0f));
    return y * (vf)((ni + 126) << 23) * splat(2.0f); /* 2^(n - 1) * 2, n in [-116, 128] */
}

/* bf16(bf16(silu(g)) * u) for VW lanes: torch's g / (1 + exp(-g)), -inf giving NaN as there. */
INLINE vh silu_times(vf g, vf u) {
    return to_bf16(rounded(g / (splat(1.0f) + exp_for_silu(-g))) * u);
}

void silu_mul_bf16(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out) {
    const int64_t iv = inter - inter % VW;
#pragma omp parallel for schedule(static) if (rows * inter >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = gate_up + r * 2 * inter, *u = g + inter;
        bf16 *o = out + r * inter;
        for (int64_t i = 0; i < iv; i += VW)
            *(vh_mem *)(o + i) = silu_times(load_bf16(g + i), load_bf16(u + i));
        if (iv < inter) { /* the last few through the same vector code, so the same exp */
            vf gt = splat(0.0f), ut = splat(0.0f);
            for (int64_t i = iv; i < inter; i++) gt[i - iv] = bf16_to_float(g[i]);
            for (int64_t i = iv; i < inter; i++) ut[i - iv] = bf16_to_float(u[i]);
            const vh tail = silu_times(gt, ut);
            for (int64_t i = iv; i < inter; i++) o[i] = tail[i - iv];
        }
    }
}

/* o[i] = bf16(bf16(a[i] * c[i]) + bf16(b[i] * s[i])) for i < n: half a head's rotation. */
INLINE void rotate_span(const bf16 *a, const bf16 *b, const bf16 *c, const bf16 *s, int64_t n,
                        bf16 *o) {
    const int64_t nv = n - n % VW;
    for (int64_t i = 0; i < nv; i += VW) {
        const vf ac = rounded(load_bf16(a + i) * load_bf16(c + i));
        store_bf16(o + i, ac + rounded(load_bf16(b + i) * load_bf16(s + i)));
    }
    for (int64_t i = nv; i < n; i++) {
        const float ac = rounded1(bf16_to_float(a[i]) * bf16_to_float(c[i]));
        o[i] = bits1(ac + rounded1(bf16_to_float(b[i]) * bf16_to_float(s[i])));
    }
}

/* x [tokens, heads, dim] (strides in elements; dim even), cos and sin [tokens, dim] -> out
 * [tokens, heads, dim] contiguous. */
void rope_bf16(const bf16 *x, int64_t token_stride, int64_t head_stride, int64_t tokens,
               int64_t heads, int64_t dim, const bf16 *cos, const bf16 *sin, bf16 *out) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const bf16 *xi = x + t * token_stride + h * head_stride;
            bf16 *o = out + (t * heads + h) * dim;
            rotate_span(xi, xi + half, c, s, half, o);
            rotate_span(xi + half, xi, c + half, s + half, half, o + half);
        }
    }
}
