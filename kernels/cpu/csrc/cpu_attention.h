/* The pieces of attention over the paged KV cache that the decode and the prefill kernels share
 * (cpu_decode.c, cpu_prefill.c): a chunk of VW tokens' scores against one query (transpose-add),
 * one row's softmax, the exp-weighted add of V rows, the page touches that start the prefetcher;
 * the decode kernel over a bf16 cache (cpu_decode_bf16.c) uses the vector pieces (transpose-add,
 * exp, scale_head). Cache layout [num_blocks, block_size, Hkv, D], fp32; a chunk never crosses
 * a block. */
#ifndef ACTORSERVE_CPU_ATTENTION_H
#define ACTORSERVE_CPU_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cpu_vec.h"

/* Shuffle masks, written out lane by lane so that they are constants: MASK(F, s) is the vi
 * {F(s, 0), F(s, 1), ..., F(s, VW - 1)}. */
#define LANES4(F, s) F(s, 0), F(s, 1), F(s, 2), F(s, 3)
#define LANES8(F, s) LANES4(F, s), F(s, 4), F(s, 5), F(s, 6), F(s, 7)
#define LANES16(F, s) \
    LANES8(F, s), F(s, 8), F(s, 9), F(s, 10), F(s, 11), F(s, 12), F(s, 13), F(s, 14), F(s, 15)
#if VW == 16
#define MASK(F, s) ((vi){LANES16(F, s)})
#elif VW == 8
#define MASK(F, s) ((vi){LANES8(F, s)})
#else
#define MASK(F, s) ((vi){LANES4(F, s)})
#endif
#define ROTATE(s, i) (((i) + (s)) % VW)

/* Horizontal max / sum of the lanes: log2(VW) rotate-and-combine steps. */
INLINE float hmax(vf v) {
#if VW >= 16
    v = vmax(v, __builtin_shuffle(v, MASK(ROTATE, 8)));
#endif
#if VW >= 8
    v = vmax(v, __builtin_shuffle(v, MASK(ROTATE, 4)));
#endif
    v = vmax(v, __builtin_shuffle(v, MASK(ROTATE, 2)));
    v = vmax(v, __builtin_shuffle(v, MASK(ROTATE, 1)));
    return v[0];
}

INLINE float hsum(vf v) {
#if VW >= 16
    v += __builtin_shuffle(v, MASK(ROTATE, 8));
#endif
#if VW >= 8
    v += __builtin_shuffle(v, MASK(ROTATE, 4));
#endif
    v += __builtin_shuffle(v, MASK(ROTATE, 2));
    v += __builtin_shuffle(v, MASK(ROTATE, 1));
    return v[0];
}

/* Transpose-add: returns r with r[j] = the sum of v[j]'s lanes, for the VW vectors v[0..VW-1]
 * (v is clobbered). Step s (1, 2, 4, ...) merges the VW / s vectors pairwise, a = v[2p] and
 * b = v[2p + 1] into v[p]: of the runs of s lanes, the even runs (FROM_A) take a's runs 0, 2, 4,
 * ... and the odd runs b's; adding the same with a's and b's runs 1, 3, 5, ... (FROM_B) sums
 * neighbouring runs. Within each 2s lanes, the first s then hold sums of a's lanes, the next s
 * b's. After the last step lane j holds all of v[j]: VW - 1 adds and 2 (VW - 1) shuffles for VW
 * dot products, instead of log2(VW) of each per product. */
#define FROM_A(s, i) ((i) / (s) % 2 * VW + (i) / (s) / 2 * 2 * (s) + (i) % (s))
#define FROM_B(s, i) (FROM_A(s, i) + (s))
#define MERGE(v, s)                                                                          \
    for (int p = 0; p < VW / (2 * (s)); p++)                                                 \
        v[p] = __builtin_shuffle(v[2 * p], v[2 * p + 1], MASK(FROM_A, s)) +                  \
               __builtin_shuffle(v[2 * p], v[2 * p + 1], MASK(FROM_B, s));

INLINE vf transpose_add(vf v[VW]) {
    MERGE(v, 1)
    MERGE(v, 2)
#if VW >= 8
    MERGE(v, 4)
#endif
#if VW >= 16
    MERGE(v, 8)
#endif
    return v[0];
}

/* Scores of n <= VW consecutive tokens k[t * stride] against q, times scale, as one vector
 * (lanes past n: 0). */
#define QREG 8 /* q vectors held in registers (D up to QREG * VW); the rest is read from L1 */
INLINE vf chunk_scores(const float *restrict q, const float *restrict k, int n, int64_t stride,
                       int64_t d, float scale) {
    const int64_t dv = d - d % VW; /* the part of a row in whole vectors; the rest is scalar */
    vf qr[QREG] = {0};
    for (int u = 0; u < QREG && u * VW < dv; u++) qr[u] = load(q + u * VW);
    vf part[VW];
    for (int t = 0; t < VW; t++) {
        vf acc = splat(0.0f);
        if (t < n) {
            const float *kt = k + t * stride;
            for (int u = 0; u < QREG && u * VW < dv; u++) acc = fmadd(qr[u], load(kt + u * VW), acc);
            for (int64_t i = QREG * VW; i < dv; i += VW) acc = fmadd(load(q + i), load(kt + i), acc);
            for (int64_t i = dv; i < d; i++) acc[0] += q[i] * kt[i];
        }
        part[t] = acc;
    }
    return transpose_add(part) * splat(scale);
}

/* o[0..d) += the sum over t < n of w[t] * v[t * stride + 0..d). STRIP vectors of o at a time
 * stay in registers, with two accumulators each (even and odd tokens) to overlap FMA latency. */
#define STRIP 8
INLINE void weighted_add(float *restrict o, const float *restrict w, const float *restrict v,
                         int n, int64_t stride, int64_t d) {
    const int64_t dv = d - d % VW;
    for (int64_t i0 = 0; i0 < dv; i0 += STRIP * VW) {
        const int strip = dv - i0 < STRIP * VW ? (int)((dv - i0) / VW) : STRIP;
        vf acc0[STRIP] = {0}, acc1[STRIP] = {0};
        for (int u = 0; u < strip; u++) acc0[u] = load(o + i0 + u * VW);
        int t = 0;
        for (; t + 1 < n; t += 2) {
            const float *v0 = v + t * stride + i0, *v1 = v0 + stride;
            const vf w0 = splat(w[t]), w1 = splat(w[t + 1]);
            for (int u = 0; u < strip; u++) {
                acc0[u] = fmadd(w0, load(v0 + u * VW), acc0[u]);
                acc1[u] = fmadd(w1, load(v1 + u * VW), acc1[u]);
            }
        }
        if (t < n)
            for (int u = 0; u < strip; u++)
                acc0[u] = fmadd(splat(w[t]), load(v + t * stride + i0 + u * VW), acc0[u]);
        for (int u = 0; u < strip; u++) store(o + i0 + u * VW, acc0[u] + acc1[u]);
    }
    for (int64_t i = dv; i < d; i++)
        for (int t = 0; t < n; t++) o[i] += w[t] * v[t * stride + i];
}

/* Touch each 4 KiB page of a cache block, so that the TLB walk and the first miss of each page
 * (which starts the hardware prefetcher's stream there) happen a block early. */
INLINE void touch_pages(const void *block, int64_t bytes) {
    const char *p = (const char *)block;
    for (int64_t off = 0; off < bytes; off += 4096) __builtin_prefetch(p + off);
    __builtin_prefetch(p + bytes - 1);
}

/* Scores per head: a row of ROW(len) floats, room for the last chunk's whole vector. */
#define ROW(len) (((len) + VW - 1) / VW * VW + VW)

/* o[0..d) *= s (a head's output by 1 / its softmax sum). */
INLINE void scale_head(float *o, int64_t d, float s) {
    const int64_t dv = d - d % VW;
    for (int64_t i = 0; i < dv; i += VW) store(o + i, load(o + i) * splat(s));
    for (int64_t i = dv; i < d; i++) o[i] *= s;
}

/* qsort order for work-item keys (a context length << 32 | an index): longest first, so that
 * the last items handed out are short and the threads finish together. */
static int longest_first(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

/* One head's row of scores s[0..len) (ROW(len) floats) -> exp(score - max) in place, lanes up to
 * the last whole vector set to 0; returns 1 / their sum. The max is exact (taken first), as the
 * reference's softmax. */
INLINE float softmax_row(float *s, int64_t len) {
    const int64_t nvec = (len + VW - 1) / VW;
    for (int64_t pos = len; pos < nvec * VW; pos++) s[pos] = -INFINITY;
    vf mx0 = splat(-INFINITY), mx1 = mx0; /* two chains to overlap the latency */
    int64_t i = 0;
    for (; i + 1 < nvec; i += 2) {
        mx0 = vmax(mx0, load(s + i * VW));
        mx1 = vmax(mx1, load(s + i * VW + VW));
    }
    if (i < nvec) mx0 = vmax(mx0, load(s + i * VW));
    const vf m = splat(hmax(vmax(mx0, mx1)));
    vf sum = splat(0.0f);
    for (i = 0; i < nvec; i++) {
        const vf p = vexp(load(s + i * VW) - m);
        store(s + i * VW, p);
        sum += p;
    }
    return 1.0f / hsum(sum);
}

#endif
