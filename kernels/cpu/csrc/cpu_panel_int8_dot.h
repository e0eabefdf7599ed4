/* The int8 panels' tile where the CPU multiplies int8 by int8 (AVX512-VNNI's vpdpbusd), included
 * by cpu_panel_gemm_int8.c only when the build targets such a CPU (-march=native there: the
 * compiler defines __AVX512VNNI__); elsewhere (an x86-64-v3 build, a CPU without VNNI) that file
 * keeps the widening tile (cpu_panel_widen.h).
 *
 * Each row of `a` is quantized as it is copied (block_rows_dot), symmetric, one fp32 scale a row:
 *     s_a = max_i |a[i]| / 127 (fp32 division; 1 for a row of zeros, NaN for one with an inf
 *           or a NaN: its results are then NaN, where the rounding would hide them)
 *     q[i] = clamp(round(a[i] / s_a), -127, 127), ties to even (fp32 division, correctly rounded)
 * and stored offset by 128, as u8 in [1, 255]: vpdpbusd multiplies an unsigned byte by a signed
 * one. The weight stays its signed int8 (the quantized weight itself), so the offset adds
 * 128 * colsum[j] (colsum: the sum of column j's weights over k) to every sum of column j; the
 * panel holds that correction, made at packing, and the tile subtracts it. Why offset the
 * activations and not the weights: the weight is the one copy kept (panels.py) and stays
 * readable as the quantized weight, and the correction is then a constant of the panel instead
 * of a sum per row and call. Every term is an integer, and for k <= DOT_MAX_K no partial sum
 * leaves int32 (|q + 128| <= 255, |w| <= 127), so the sum is exact, in any order:
 *     out[m, j] = (float)(sum_i q[m, i] * Wq[j, i]) * (s_a[m] * scale[j])
 * the int32 sum converted to fp32 (nearest even), times the fp32 product of the two scales.
 * A row's result does not depend on the other rows, nor on how its sums are split.
 *
 * The panel (NR columns; panel_bytes_dot(k) long, a multiple of 64): NR fp32 scales, NR int32
 * corrections (128 * colsum), then k4 = ceil(k / 4) groups of NR x 4 bytes, group g's column j
 * holding Wq[j][4g .. 4g + 3] (zero past k and past n): the four bytes vpdpbusd sums into lane
 * j. The copy of a row block: k4 steps of MR x 4 bytes (row r's q[4g .. 4g + 3] + 128; 128 past
 * k), then one step of the MR row scales: [k4 + 1][MR] 4-byte elements, so the loop's `steps` is
 * k4 + 1.
 */
#ifndef ACTORSERVE_CPU_PANEL_INT8_DOT_H
#define ACTORSERVE_CPU_PANEL_INT8_DOT_H

#include <stdint.h>

#include "cpu_panel.h"

/* The widest k whose sums stay in int32: k * 255 * 127 < 2^31. */
#define DOT_MAX_K 66311
#define DOT_HEADER_BYTES (8 * NR)

static inline int64_t dot_groups(int64_t k) { return (k + 3) / 4; }

static inline int64_t panel_bytes_dot(int64_t k) {
    return (DOT_HEADER_BYTES + dot_groups(k) * 4 * NR + 63) / 64 * 64;
}

/* Row `row` of a (k floats) -> its scale, and its quantized bytes + 128 as k4 4-byte groups at
 * dst, MR groups apart (its column of a row block's copy). */
static inline void quantize_row_dot(const float *row, int64_t k, uint32_t *dst, float *scale) {
    /* finite: the sum of x * 0, which is NaN unless every x is finite */
    __m512 largest = _mm512_setzero_ps(), finite = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 valid = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(valid, row + i);
        largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
        finite = _mm512_add_ps(finite, _mm512_mul_ps(x, _mm512_setzero_ps()));
    }
    const float amax = _mm512_reduce_max_ps(largest);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    /* a row holding an inf or a NaN gets a NaN scale, so its results are NaN, as fp32's are */
    *scale = _mm512_reduce_add_ps(finite) == 0.0f ? s : __builtin_nanf("");
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i offset = _mm512_set1_epi32(128);
    const int64_t k4 = dot_groups(k);
    for (int64_t g0 = 0; g0 < k4; g0 += 4) { /* 16 floats: four groups */
        const int64_t first = 4 * g0, left = k - first;
        const __mmask16 valid = left >= 16 ? (__mmask16)0xffff
                                : left > 0 ? (__mmask16)((1u << left) - 1)
                                           : (__mmask16)0;
        __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(valid, row + first), vs);
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        const __m512i u = _mm512_add_epi32(_mm512_cvttps_epi32(q), offset); /* 128 past k */
        uint8_t bytes[16];
        _mm_storeu_si128((__m128i *)bytes, _mm512_cvtepi32_epi8(u));
        for (int64_t g = g0; g < g0 + 4 && g < k4; g++)
            __builtin_memcpy(dst + g * MR, bytes + 4 * (g - g0), 4);
    }
}

/* Row block rb of a [m, k] fp32 (rows a_stride apart) -> at's [k4 + 1][MR] (rows past m: q = 0,
 * scale 0). */
static inline void block_rows_dot(const float *a, int64_t m, int64_t k, int64_t a_stride,
                                  int64_t rb, uint32_t *at) {
    const int64_t k4 = dot_groups(k);
    uint32_t *dst = at + rb * (k4 + 1) * MR;
    float *scales = (float *)(dst + k4 * MR);
    for (int r = 0; r < MR; r++) {
        const int64_t row = rb * MR + r;
        if (row < m) {
            quantize_row_dot(a + row * a_stride, k, dst + r, scales + r);
        } else {
            for (int64_t g = 0; g < k4; g++) dst[g * MR + r] = 0x80808080u;
            scales[r] = 0.0f;
        }
    }
}

/* The first R rows of a tile (R a constant once inlined); rows past R are left zero. The int32
 * sums accumulate in `acc`, fully unrolled over MR x NRV so that they stay in registers; each is
 * corrected, converted and scaled into c once, after the last group. */
INLINE void dot_tile_rows(const uint32_t *at, const char *panel, int64_t k4, const char *prefetch,
                          int64_t prefetch_lines, vf c[MR][NRV], const int R) {
    const char *w = panel + DOT_HEADER_BYTES;
    const int64_t lines_per_step = (prefetch_lines + k4 - 1) / (k4 > 0 ? k4 : 1);
    vi acc[MR][NRV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++) acc[r][v] = (vi){0};
    for (int64_t g = 0; g < k4; g++) {
        vi b[NRV];
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++) b[v] = (vi)_mm512_loadu_si512(w + g * 4 * NR + v * 64);
        for (int64_t j = g * lines_per_step; j < (g + 1) * lines_per_step && j < prefetch_lines;
             j++)
            __builtin_prefetch(prefetch + j * 64, 0, 2);
        const uint32_t *ag = at + g * MR;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vi ar = (vi)_mm512_set1_epi32((int)ag[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++)
                acc[r][v] = (vi)_mm512_dpbusd_epi32((__m512i)acc[r][v], (__m512i)ar, (__m512i)b[v]);
        }
    }
    const float *row_scale = (const float *)(at + k4 * MR);
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++) {
            if (r >= R) {
                c[r][v] = splat(0.0f);
                continue;
            }
            const vi correction = (vi)_mm512_loadu_si512(panel + 4 * NR + v * 64);
            const vf sum = __builtin_convertvector(acc[r][v] - correction, vf);
            c[r][v] = sum * (splat(row_scale[r]) * load((const float *)panel + v * VW));
        }
}

/* c = one MR x NR tile over k4 groups: its first `rows` rows; meanwhile the next panel's slice
 * is prefetched. */
INLINE void dot_tile(const void *at_block, const void *panel_start, int64_t k4, int rows,
                     const char *prefetch, int64_t prefetch_lines, vf c[MR][NRV]) {
    const uint32_t *at = at_block;
    const char *panel = panel_start;
    switch (rows) {
#define ROWS(R)                                                               \
    case R:                                                                   \
        dot_tile_rows(at, panel, k4, prefetch, prefetch_lines, c, R);         \
        return;
        ROWS(1)
        ROWS(2)
        ROWS(3)
        ROWS(4)
        ROWS(5)
        ROWS(6)
        ROWS(7)
#undef ROWS
    default:
        dot_tile_rows(at, panel, k4, prefetch, prefetch_lines, c, MR);
    }
}

#endif
