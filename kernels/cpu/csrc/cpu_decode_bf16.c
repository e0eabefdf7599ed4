/* Decode attention over a bf16 paged KV cache on CPU: one work item of decode_attention_team
 * (cpu_decode.c) -- the query heads of KV heads [kvh, kvh + nkv) of one sequence -- in a single
 * pass over its cache blocks. q and out fp32; sums, softmax and the output in fp32.
 *
 * Why its own kernel: at bf16 a token's K and V rows are half the bytes of fp32, so widening each
 * element to fp32 and doing the fp32 kernel's work on it (vpmovzx + shift + FMA per 16 elements,
 * a second pass over the blocks for V, each query head of a group redoing the loads) leaves the
 * core, not the memory, as the limit. Here:
 * - scores: q is rounded to bf16 once per item and kept as pairs; a token's K row is read as
 *   pairs and each pair vector meets q in one dot-product-of-pairs (vdpbf16ps where the CPU has
 *   AVX512-BF16, else both halves widened by a shift and a mask and two FMAs). A tile of HS
 *   query heads (those sharing the KV head) x TP = VW / HS tokens leaves VW vectors of partial
 *   sums; one transpose-add turns them into one vector of their VW scores, lane hh * TP + t for
 *   head hh and token t. Each K row is loaded once for every head of the tile.
 * - softmax online, a chunk of VW tokens at a time (a chunk never crosses a block): each lane
 *   keeps its head's running max and its own running sum; when a chunk raises a head's max,
 *   that head's sum and output are scaled by exp(old max - new max) first. Exact in exact
 *   arithmetic, so only rounding separates it from the reference's exact-max-first softmax.
 * - P x V: a V row read as pairs widens to fp32 by a shift (even elements) and a mask (odd
 *   elements), exactly; the output is kept in that split order (per vector of pairs: the VW even
 *   elements, then the VW odd ones) and put back in order at the end, divided by the sum.
 * - the rows this item will read PREFETCH_BLOCKS blocks on (an id from the table, which the
 *   hardware prefetchers cannot guess) are prefetched one token at a time, as the same token's
 *   K row of the block at hand is read: spread out so, the prefetches never crowd the loads
 *   out of the miss buffers, where a burst of a block's worth at once did.
 * Elements past the last whole vector of pairs (head_dim not a multiple of 2 VW) go scalar.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_attention.h"
#include "cpu_kernels.h"

/* How far ahead rows are prefetched, in blocks, and into which cache: two blocks cover the
 * memory's latency even for an item of one KV head (a block's rows of one head are a few KiB);
 * locality 2 (prefetcht1) fills L2 and leaves L1, whose few miss buffers the loads of the block
 * at hand need, alone -- prefetcht0 was the slowest choice measured, no prefetch next. */
#define PREFETCH_BLOCKS 2
#define PREFETCH_LOCALITY 2

/* VW pairs of bf16 (2 VW elements) as 32-bit lanes: element 2i in lane i's low half. */
typedef uint32_t pairs_mem __attribute__((vector_size(4 * VW), aligned(2), may_alias));
#define HIGH_HALVES 0xffff0000u

INLINE vu load_pairs(const uint16_t *p) { return *(const pairs_mem *)p; }
INLINE vf even_elements(vu pairs) { return (vf)(pairs << 16); }
INLINE vf odd_elements(vu pairs) { return (vf)(pairs & HIGH_HALVES); }

/* acc + per lane, the dot product of q's pair with k's pair. */
INLINE vf dot_pairs(vf acc, vu q, vu k) {
#if defined(__AVX512BF16__) && VW == 16
    return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k);
#else
    acc = fmadd(even_elements(q), even_elements(k), acc);
    return fmadd(odd_elements(q), odd_elements(k), acc);
#endif
}

INLINE float round_to_bf16(float x) {
    vf v = splat(0.0f);
    v[0] = x;
    return bf16_to_float(round_bf16(v)[0]);
}

/* Floats of scratch an item of `heads` query heads needs (decode_attention_team allocates it
 * per thread): the output accumulators (heads * d), each head set's running max and sum (VW
 * each), a chunk's probabilities (VW * VW), q's tail (heads * d) and q's bf16 pairs. */
int64_t attend_bf16_scratch(int64_t heads, int64_t d) {
    return heads * d + 2 * heads * VW + VW * VW + heads * d + (heads * d + 1) / 2 + VW;
}

/* Lanes within each run of TP lanes, all set to the run's maximum. */
INLINE vf group_max(vf m, const int TP) {
    for (int s = 1; s < TP; s *= 2) {
        vi rotate;
        for (int l = 0; l < VW; l++) rotate[l] = l / TP * TP + (l % TP + s) % TP;
        m = vmax(m, __builtin_shuffle(m, rotate));
    }
    return m;
}

/* Prefetch `bytes` of a K row at k and of a V row at v, a cache line at a time. */
INLINE void prefetch_row(const uint16_t *k, const uint16_t *v, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char *)k + off, 0, PREFETCH_LOCALITY);
        __builtin_prefetch((const char *)v + off, 0, PREFETCH_LOCALITY);
    }
}

/* Tiles of HS query heads: HS a power of two, at most MAX_HS (and VW); SV vectors of pairs of
 * each head's output in registers at a time during P x V, and PAR sets of them (even and odd
 * tokens) where one head alone would leave too few sums in flight to cover the FMA latency. */
#define MAX_HS 8
#define SV(HS) ((HS) >= 8 ? 1 : 8 / (HS))
#define PAR(HS) ((HS) == 1 ? 2 : 1)
#define MAX_ACC 32 /* PAR * HS * 2 * SV, at most */

/* One chunk of n <= VW tokens (K rows at k, V rows at v, `stride` elements apart) for the head
 * set of HS query heads whose state begins at acc (HS * d floats), max and sum (VW each):
 * scores, the online softmax step, out += p * V. qbits: the heads' bf16 q, d apart; qtail their
 * elements past dp, rounded, (d - dp) apart; p: VW * VW floats. The rows past n are not read:
 * their lanes take row 0 and are masked. Meanwhile rows [0, later_rows) at later_k, later_v
 * (the same rows of a later block) are prefetched. */
INLINE void chunk(const uint16_t *restrict k, const uint16_t *restrict v, int n, int64_t stride,
                  int64_t d, float scale, const uint16_t *restrict qbits,
                  const float *restrict qtail, float *restrict acc, float *restrict max,
                  float *restrict sum, float *restrict p, const uint16_t *later_k,
                  const uint16_t *later_v, int later_rows, const int HS) {
    const int TP = VW / HS, sv = SV(HS), par = PAR(HS);
    const int64_t dp = d - d % (2 * VW), npv = dp / (2 * VW);
    vf tile[MAX_HS];
    for (int tt = 0; tt < HS; tt++) {
        vf part[VW];
        for (int t = 0; t < TP; t++) {
            const int token = tt * TP + t < n ? tt * TP + t : 0;
            const uint16_t *kt = k + token * stride;
            if (tt * TP + t < later_rows)
                prefetch_row(later_k + (tt * TP + t) * stride, later_v + (tt * TP + t) * stride,
                             2 * d);
            for (int hh = 0; hh < HS; hh++) part[hh * TP + t] = splat(0.0f);
            for (int64_t u = 0; u < npv; u++) {
                const vu kp = load_pairs(kt + u * 2 * VW);
                for (int hh = 0; hh < HS; hh++)
                    part[hh * TP + t] = dot_pairs(part[hh * TP + t],
                                                  load_pairs(qbits + hh * d + u * 2 * VW), kp);
            }
        }
        for (int64_t i = dp; i < d; i++)
            for (int t = 0; t < TP; t++) {
                const int token = tt * TP + t < n ? tt * TP + t : 0;
                const float kf = bf16_to_float(k[token * stride + i]);
                for (int hh = 0; hh < HS; hh++)
                    part[hh * TP + t][0] += qtail[hh * (d - dp) + i - dp] * kf;
            }
        tile[tt] = transpose_add(part) * splat(scale);
        if (n < VW) { /* lanes of tokens past n: -inf, so that they weigh 0 */
            vi token;
            for (int l = 0; l < VW; l++) token[l] = tt * TP + l % TP;
            tile[tt] = vselect(token < n, tile[tt], splat(-INFINITY));
        }
    }
    /* online softmax: the heads' max over the chunk, then rescale what came before */
    vf chunk_max = tile[0];
    for (int tt = 1; tt < HS; tt++) chunk_max = vmax(chunk_max, tile[tt]);
    const vf old_max = load(max), new_max = vmax(old_max, group_max(chunk_max, TP));
    vf total = load(sum);
    if (any_lane(new_max > old_max)) {
        const vf alpha = vexp(old_max - new_max); /* 0 for the first chunk (old max -inf) */
        store(max, new_max);
        total *= alpha;
        for (int hh = 0; hh < HS; hh++) scale_head(acc + hh * d, d, alpha[hh * TP]);
    }
    for (int tt = 0; tt < HS; tt++) {
        const vf e = vexp(tile[tt] - new_max);
        total += e;
        store(p + tt * VW, e);
    }
    store(sum, total);
    /* out += p * V; a[(r * HS + hh) * 2 * sv + s]: set r, head hh, vector s of the strip */
    for (int64_t u0 = 0; u0 < npv; u0 += sv) {
        vf a[MAX_ACC];
        for (int r = 0; r < par; r++)
            for (int hh = 0; hh < HS; hh++)
                for (int s = 0; s < 2 * sv; s++)
                    a[(r * HS + hh) * 2 * sv + s] =
                        r == 0 && u0 + s / 2 < npv
                            ? load(acc + hh * d + (u0 + s / 2) * 2 * VW + s % 2 * VW)
                            : splat(0.0f);
        for (int t = 0; t < n; t += par)
            for (int r = 0; r < par; r++) {
                const int token = t + r < n ? t + r : t; /* a second set past n: weight 0 */
                const float *pt = p + token / TP * VW + token % TP;
                for (int s = 0; s < sv && u0 + s < npv; s++) {
                    const vu x = load_pairs(v + token * stride + (u0 + s) * 2 * VW);
                    const vf even = even_elements(x), odd = odd_elements(x);
                    for (int hh = 0; hh < HS; hh++) {
                        const vf w = t + r < n ? splat(pt[hh * TP]) : splat(0.0f);
                        vf *pair = a + (r * HS + hh) * 2 * sv + 2 * s;
                        pair[0] = fmadd(w, even, pair[0]);
                        pair[1] = fmadd(w, odd, pair[1]);
                    }
                }
            }
        for (int hh = 0; hh < HS; hh++)
            for (int s = 0; s < 2 * sv && u0 + s / 2 < npv; s++) {
                vf total_s = a[hh * 2 * sv + s];
                for (int r = 1; r < par; r++) total_s += a[(r * HS + hh) * 2 * sv + s];
                store(acc + hh * d + (u0 + s / 2) * 2 * VW + s % 2 * VW, total_s);
            }
    }
    for (int64_t i = dp; i < d; i++)
        for (int t = 0; t < n; t++) {
            const float x = bf16_to_float(v[t * stride + i]);
            for (int hh = 0; hh < HS; hh++)
                acc[hh * d + i] += p[t / TP * VW + hh * TP + t % TP] * x;
        }
}

/* The item (see the top of the file and decode_attention_team); HS query heads per tile, a
 * power of two dividing g, at most VW. */
INLINE void attend(const float *restrict q, const uint16_t *restrict k_cache,
                   const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t len,
                   int64_t bs, int64_t hkv, int64_t kvh, int64_t nkv, int64_t d, int64_t g,
                   float scale, float *restrict scratch, float *restrict out, const int HS) {
    const int TP = VW / HS;
    const int64_t heads = nkv * g, sets = heads / HS, dp = d - d % (2 * VW);
    const int64_t token_stride = hkv * d, block_stride = bs * token_stride;
    float *acc = scratch, *max = acc + heads * d, *sum = max + sets * VW, *p = sum + sets * VW;
    float *qtail = p + VW * VW;
    uint16_t *qbits = (uint16_t *)(qtail + heads * d);
    for (int64_t j = 0; j < heads; j++) {
        for (int64_t i = 0; i < dp; i += VW)
            *(vh_mem *)(qbits + j * d + i) = round_bf16(load(q + j * d + i));
        for (int64_t i = dp; i < d; i++) qtail[j * (d - dp) + i - dp] = round_to_bf16(q[j * d + i]);
    }
    memset(acc, 0, sizeof(float) * heads * d);
    for (int64_t s = 0; s < sets; s++) {
        store(max + s * VW, splat(-INFINITY));
        store(sum + s * VW, splat(0.0f));
    }
    const int64_t nblocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t start = b * bs, in_block = len - start < bs ? len - start : bs;
        const int64_t base = (int64_t)table[b] * block_stride + kvh * d;
        const int64_t later = b + PREFETCH_BLOCKS; /* the block whose rows are prefetched */
        const int64_t later_base =
            later < nblocks ? (int64_t)table[later] * block_stride + kvh * d : -1;
        const int64_t later_len = len - later * bs < bs ? len - later * bs : bs;
        for (int64_t c = 0; c < in_block; c += VW) {
            const int n = in_block - c < VW ? (int)(in_block - c) : VW;
            const int later_rows = later_base < 0       ? 0
                                   : later_len - c < VW ? (int)(later_len - c)
                                                        : VW;
            for (int64_t h = 0; h < nkv; h++) {
                const int64_t row = c * token_stride + h * d;
                const uint16_t *k = k_cache + base + row, *v = v_cache + base + row;
                const uint16_t *later_k = later_rows > 0 ? k_cache + later_base + row : NULL;
                const uint16_t *later_v = later_rows > 0 ? v_cache + later_base + row : NULL;
                for (int64_t s = 0; s < g / HS; s++) { /* the first set prefetches */
                    const int64_t set = h * (g / HS) + s, j = set * HS;
                    const int rows = s == 0 ? later_rows : 0;
                    if (n == VW) /* a copy with n constant: no masks, no clamps */
                        chunk(k, v, VW, token_stride, d, scale, qbits + j * d, qtail + j * (d - dp),
                              acc + j * d, max + set * VW, sum + set * VW, p, later_k, later_v,
                              rows, HS);
                    else
                        chunk(k, v, n, token_stride, d, scale, qbits + j * d, qtail + j * (d - dp),
                              acc + j * d, max + set * VW, sum + set * VW, p, later_k, later_v,
                              rows, HS);
                }
            }
        }
    }
    /* out = acc / the sum, acc's split order (per vector of pairs: evens, then odds) undone */
    for (int64_t set = 0; set < sets; set++)
        for (int hh = 0; hh < HS; hh++) {
            const int64_t j = set * HS + hh;
            float total = 0.0f;
            for (int t = 0; t < TP; t++) total += sum[set * VW + hh * TP + t];
            const float inv = 1.0f / total;
            const float *a = acc + j * d;
            float *o = out + j * d;
            vi low, high; /* evens and odds interleaved: the first VW / 2 of each, the rest */
            for (int l = 0; l < VW; l++) low[l] = l / 2 + l % 2 * VW, high[l] = low[l] + VW / 2;
            for (int64_t u = 0; u < dp; u += 2 * VW) {
                const vf even = load(a + u), odd = load(a + u + VW);
                store(o + u, __builtin_shuffle(even, odd, low) * splat(inv));
                store(o + u + VW, __builtin_shuffle(even, odd, high) * splat(inv));
            }
            for (int64_t i = dp; i < d; i++) o[i] = a[i] * inv;
        }
}

#define ATTEND_ARGS                                                                           \
    const float *restrict q, const uint16_t *restrict k_cache,                                \
        const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t len,         \
        int64_t bs, int64_t hkv, int64_t kvh, int64_t nkv, int64_t d, int64_t g, float scale, \
        float *restrict scratch, float *restrict out
#define ATTEND_COPY(D, NAME, HS)                                                              \
    static void attend_##D##_##NAME(ATTEND_ARGS) {                                            \
        attend(q, k_cache, v_cache, table, len, bs, hkv, kvh, nkv, D ? D : d, g, scale,       \
               scratch, out, HS);                                                             \
    }
/* (HS 8 where VW is 4: a copy never chosen, kept compilable) */
#define ATTEND_COPIES(D)                                                                      \
    ATTEND_COPY(D, 1, 1) ATTEND_COPY(D, 2, 2) ATTEND_COPY(D, 4, 4) ATTEND_COPY(D, 8, VW < 8 ? VW : 8)
ATTEND_COPIES(64)
ATTEND_COPIES(128)
ATTEND_COPIES(0) /* any head_dim */

/* Query heads [kvh * g, (kvh + nkv) * g) of one sequence against its `len` cached tokens; q and
 * out point at the first of them; scratch holds attend_bf16_scratch(nkv * g, d) floats. Copies
 * with head_dim 64 and 128 fixed (their vector loops unrolled) and one for any. */
void attend_bf16(ATTEND_ARGS) {
    /* query heads per tile: the largest power of two dividing g, at most min(8, VW) */
    int hs = 1;
    while (hs < 8 && hs < VW && g % (2 * hs) == 0) hs *= 2;
    static void (*const copies[3][4])(ATTEND_ARGS) = {
        {attend_64_1, attend_64_2, attend_64_4, attend_64_8},
        {attend_128_1, attend_128_2, attend_128_4, attend_128_8},
        {attend_0_1, attend_0_2, attend_0_4, attend_0_8},
    };
    const int which = d == 64 ? 0 : d == 128 ? 1 : 2;
    const int log_hs = hs == 1 ? 0 : hs == 2 ? 1 : hs == 4 ? 2 : 3;
    copies[which][log_hs](q, k_cache, v_cache, table, len, bs, hkv, kvh, nkv, d, g, scale,
                          scratch, out);
}
