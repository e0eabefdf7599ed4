/* Prefill attention over the paged KV cache on CPU, fp32: the rows of a step whose sequence
 * computes a chunk of n > 1 tokens (their K/V already stored in the cache). Semantics of
 * kernels/reference.py (paged_attention) on those rows; decode rows are left to cpu_decode.c.
 * Shapes and layouts as there (q, out [T, Hq, D]; caches [NB, BS, Hkv, D]; int32 metadata).
 *
 * Token j of a chunk of n, in a sequence of context length L (seq_lens, this chunk included),
 * sits at position L - n + j and attends to positions 0 .. L - n + j: the cached prefix and the
 * chunk up to itself (causal).
 *
 * Why C: torch's SDPA needs K/V gathered out of the cache blocks into copies first, and at
 * these short fp32 contexts it runs far below the machine's arithmetic rate. Here a work item is
 * a tile of up to TILE consecutive tokens of one chunk, one KV head and its G query heads: each
 * VW-token chunk of K (then V) is read from the cache once per item and used by all TILE x G
 * query rows while it is in L1, and each row stops at its own causal length. Per row the
 * arithmetic is the decode kernel's (cpu_attention.h: scores by transpose-add, exact-max softmax,
 * exp-weighted V), so a row's result is what the decode kernel gives for that token. Items go
 * longest context first (dynamic schedule), so the threads finish together.
 *
 * Scores: where the head size is a multiple of VW, each chunk of K is transposed once per item
 * and scored against ROWS_T query rows at a time with the transpose-add's sums done across
 * vectors instead of lanes (chunk_scores_t): the same sums in the same order, without its
 * shuffles per row, which were most of the scores' instructions.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_attention.h"

#define TILE 16 /* query tokens per work item */
#define MAX_T_DIM 256 /* head sizes up to this (a multiple of VW) score transposed chunks */

/* chunk_scores for two queries against the same keys: each key vector is loaded once for both.
 * Each result is computed in chunk_scores' order, so it is the same to the bit. */
INLINE void chunk_scores2(const float *restrict q0, const float *restrict q1,
                          const float *restrict k, int n, int64_t stride, int64_t d, float scale,
                          float *restrict s0, float *restrict s1) {
    const int64_t dv = d - d % VW;
    vf part0[VW], part1[VW];
    for (int t = 0; t < VW; t++) {
        vf acc0 = splat(0.0f), acc1 = acc0;
        if (t < n) {
            const float *kt = k + t * stride;
            for (int64_t i = 0; i < dv; i += VW) {
                const vf kv = load(kt + i);
                acc0 = fmadd(load(q0 + i), kv, acc0);
                acc1 = fmadd(load(q1 + i), kv, acc1);
            }
            for (int64_t i = dv; i < d; i++) {
                acc0[0] += q0[i] * kt[i];
                acc1[0] += q1[i] * kt[i];
            }
        }
        part0[t] = acc0, part1[t] = acc1;
    }
    store(s0, transpose_add(part0) * splat(scale));
    store(s1, transpose_add(part1) * splat(scale));
}

/* A chunk's n <= VW keys transposed: kt[i * VW + t] = k[t * stride + i] for i < d (a multiple of
 * VW), 0 in lanes t >= n. Each VW x VW block is transposed in registers: log2(VW) rounds of VW
 * two-source shuffles, round s swapping bit s of the token index with bit s of the lane. */
#define SWAP_LO(s, i) ((i) & (s) ? VW + ((i) ^ (s)) : (i))
#define SWAP_HI(s, i) ((i) & (s) ? VW + (i) : ((i) ^ (s)))
#define TRANSPOSE_ROUND(v, s)                                        \
    for (int i = 0; i < VW; i++)                                     \
        if (!(i & (s))) {                                            \
            const vf a = v[i], b = v[i | (s)];                       \
            v[i] = __builtin_shuffle(a, b, MASK(SWAP_LO, s));        \
            v[i | (s)] = __builtin_shuffle(a, b, MASK(SWAP_HI, s));  \
        }
INLINE void transpose_chunk(const float *restrict k, int n, int64_t stride, int64_t d,
                            float *restrict kt) {
    for (int64_t i0 = 0; i0 < d; i0 += VW) {
        vf v[VW];
        for (int t = 0; t < VW; t++) v[t] = t < n ? load(k + t * stride + i0) : splat(0.0f);
        TRANSPOSE_ROUND(v, 1)
        TRANSPOSE_ROUND(v, 2)
#if VW >= 8
        TRANSPOSE_ROUND(v, 4)
#endif
#if VW >= 16
        TRANSPOSE_ROUND(v, 8)
#endif
        for (int i = 0; i < VW; i++) store(kt + (i0 + i) * VW, v[i]);
    }
}

#if VW == 16
#define LEVELS 4
#elif VW == 8
#define LEVELS 3
#else
#define LEVELS 2
#endif
#define ROWS_T 4 /* query rows that share each load of a transposed key vector */

/* chunk_scores for nq <= ROWS_T query rows q[x] against a transposed chunk kt, stored at s[x]:
 * the same to the bit. There, lane l of a key's accumulator holds the FMA chain over q[l] k[l],
 * q[l + VW] k[l + VW], ..., and transpose_add sums the VW lanes pairwise in order, ((0 + 1) +
 * (2 + 3)) + ...; here vector l holds that chain for every key of the chunk at once (a lane a
 * key), and the same pairwise sums run across the VW vectors (a binary counter: level[x][b]
 * holds row x's sum of the last whole group of 2^b vectors). No shuffles, and each key vector loaded
 * serves nq rows. */
INLINE void chunk_scores_t(int nq, const float *const *q, const float *restrict kt, int64_t d,
                           float scale, float *const *s) {
    vf level[ROWS_T][LEVELS + 1];
#pragma GCC unroll 16
    for (int l = 0; l < VW; l++) {
        vf p[ROWS_T];
        for (int x = 0; x < nq; x++) p[x] = splat(0.0f);
        for (int64_t i = l; i < d; i += VW) {
            const vf k = load(kt + i * VW);
            for (int x = 0; x < nq; x++) p[x] = fmadd(splat(q[x][i]), k, p[x]);
        }
        int b = 0;
        for (; (l >> b) & 1; b++)
            for (int x = 0; x < nq; x++) p[x] = level[x][b] + p[x];
        for (int x = 0; x < nq; x++) level[x][b] = p[x];
    }
    for (int x = 0; x < nq; x++) store(s[x], level[x][LEVELS] * splat(scale));
}

/* Pass 1 of attend_tile over one chunk: rows (r, j) for r >= r0, nq at a time. */
INLINE void chunk_scores_tile(const float *restrict q, int64_t q_stride, const float *restrict kt,
                              int64_t r0, int64_t rows, int64_t g, int64_t d, float scale,
                              float *restrict scores, int64_t row, int64_t pos) {
    for (int64_t m = r0 * g; m < rows * g; m += ROWS_T) {
        const int nq = rows * g - m < ROWS_T ? (int)(rows * g - m) : ROWS_T;
        const float *qs[ROWS_T];
        float *ss[ROWS_T];
        for (int x = 0; x < nq; x++) {
            qs[x] = q + (m + x) / g * q_stride + (m + x) % g * d;
            ss[x] = scores + (m + x) * row + pos;
        }
        switch (nq) {
        case 4: chunk_scores_t(4, qs, kt, d, scale, ss); break;
        case 3: chunk_scores_t(3, qs, kt, d, scale, ss); break;
        case 2: chunk_scores_t(2, qs, kt, d, scale, ss); break;
        default: chunk_scores_t(1, qs, kt, d, scale, ss); break;
        }
    }
}

/* weighted_add for two rows over the same n V rows, each V vector loaded once for both; each
 * row's sums in weighted_add's order (even and odd tokens apart, added last): the same to the
 * bit. */
#define STRIP2 4
INLINE void weighted_add2(float *restrict o0, float *restrict o1, const float *restrict w0,
                          const float *restrict w1, const float *restrict v, int n,
                          int64_t stride, int64_t d) {
    const int64_t dv = d - d % VW;
    for (int64_t i0 = 0; i0 < dv; i0 += STRIP2 * VW) {
        const int strip = dv - i0 < STRIP2 * VW ? (int)((dv - i0) / VW) : STRIP2;
        vf a0[STRIP2] = {0}, a1[STRIP2] = {0}, b0[STRIP2] = {0}, b1[STRIP2] = {0};
        for (int u = 0; u < strip; u++) a0[u] = load(o0 + i0 + u * VW);
        for (int u = 0; u < strip; u++) b0[u] = load(o1 + i0 + u * VW);
        int t = 0;
        for (; t + 1 < n; t += 2) {
            const float *v0 = v + t * stride + i0, *v1 = v0 + stride;
            const vf wa0 = splat(w0[t]), wa1 = splat(w0[t + 1]);
            const vf wb0 = splat(w1[t]), wb1 = splat(w1[t + 1]);
            for (int u = 0; u < strip; u++) {
                const vf x0 = load(v0 + u * VW), x1 = load(v1 + u * VW);
                a0[u] = fmadd(wa0, x0, a0[u]);
                a1[u] = fmadd(wa1, x1, a1[u]);
                b0[u] = fmadd(wb0, x0, b0[u]);
                b1[u] = fmadd(wb1, x1, b1[u]);
            }
        }
        if (t < n)
            for (int u = 0; u < strip; u++) {
                const vf x = load(v + t * stride + i0 + u * VW);
                a0[u] = fmadd(splat(w0[t]), x, a0[u]);
                b0[u] = fmadd(splat(w1[t]), x, b0[u]);
            }
        for (int u = 0; u < strip; u++) store(o0 + i0 + u * VW, a0[u] + a1[u]);
        for (int u = 0; u < strip; u++) store(o1 + i0 + u * VW, b0[u] + b1[u]);
    }
    for (int64_t i = dv; i < d; i++)
        for (int t = 0; t < n; t++) {
            o0[i] += w0[t] * v[t * stride + i];
            o1[i] += w1[t] * v[t * stride + i];
        }
}

/* Tokens [0, rows) of a tile, token r at position first + r, query heads [kvh g, kvh g + g);
 * q and out point at token 0's first such head, tokens q_stride floats apart; scores holds
 * rows * g * ROW(first + rows) floats. */
INLINE void attend_tile(const float *restrict q, int64_t q_stride, const float *restrict k_cache,
                        const float *restrict v_cache, const int32_t *restrict table,
                        int64_t first, int64_t rows, int64_t bs, int64_t hkv, int64_t kvh,
                        int64_t d, int64_t g, float scale, float *restrict scores,
                        float *restrict out) {
    const int64_t token_stride = hkv * d, block_stride = bs * token_stride;
    const int64_t len = first + rows, row = ROW(len);
    const int64_t nblocks = (len + bs - 1) / bs;
    /* pass 1: scores[r g + j][pos] for pos < first + r + 1 (and the rest of its last chunk) */
    for (int64_t b = 0; b < nblocks; b++) {
        if (b + 1 < nblocks) touch_pages(k_cache + (int64_t)table[b + 1] * block_stride,
                                         block_stride * (int64_t)sizeof(float));
        const int64_t start = b * bs, in_block = len - start < bs ? len - start : bs;
        const float *k = k_cache + (int64_t)table[b] * block_stride + kvh * d;
        for (int64_t c = 0; c < in_block; c += VW) {
            const int n = in_block - c < VW ? (int)(in_block - c) : VW;
            const int64_t pos = start + c; /* rows r with first + r >= pos see this chunk */
            const float *kc = k + c * token_stride;
            int64_t r = pos > first ? pos - first : 0;
            if (d % VW == 0 && d <= MAX_T_DIM) {
                float kt[d * VW];
                transpose_chunk(kc, n, token_stride, d, kt);
                chunk_scores_tile(q, q_stride, kt, r, rows, g, d, scale, scores, row, pos);
                continue;
            }
            for (; r + 1 < rows; r += 2)
                for (int64_t j = 0; j < g; j++)
                    chunk_scores2(q + r * q_stride + j * d, q + (r + 1) * q_stride + j * d, kc,
                                  n, token_stride, d, scale, scores + (r * g + j) * row + pos,
                                  scores + ((r + 1) * g + j) * row + pos);
            for (; r < rows; r++)
                for (int64_t j = 0; j < g; j++)
                    store(scores + (r * g + j) * row + pos,
                          chunk_scores(q + r * q_stride + j * d, kc, n, token_stride, d, scale));
        }
    }
    float inv[rows * g];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < g; j++) {
            inv[r * g + j] = softmax_row(scores + (r * g + j) * row, first + r + 1);
            memset(out + r * q_stride + j * d, 0, sizeof(float) * d);
        }
    /* pass 2: out = the exp-weighted sum of V over each row's own positions, then / the sum */
    for (int64_t b = 0; b < nblocks; b++) {
        if (b + 1 < nblocks) touch_pages(v_cache + (int64_t)table[b + 1] * block_stride,
                                         block_stride * (int64_t)sizeof(float));
        const int64_t start = b * bs, in_block = len - start < bs ? len - start : bs;
        const float *v = v_cache + (int64_t)table[b] * block_stride + kvh * d;
        for (int64_t c = 0; c < in_block; c += VW) {
            const int n = in_block - c < VW ? (int)(in_block - c) : VW;
            const int64_t pos = start + c;
            const float *vc = v + c * token_stride;
            for (int64_t r = pos > first ? pos - first : 0; r < rows; r++) {
                const int64_t seen = first + r + 1 - pos; /* this row's positions in the chunk */
                const int m = seen < n ? (int)seen : n;
                if (m == n && r + 1 < rows) { /* rows r and r + 1 both see the whole chunk */
                    for (int64_t j = 0; j < g; j++)
                        weighted_add2(out + r * q_stride + j * d, out + (r + 1) * q_stride + j * d,
                                      scores + (r * g + j) * row + pos,
                                      scores + ((r + 1) * g + j) * row + pos, vc, n, token_stride,
                                      d);
                    r++;
                    continue;
                }
                for (int64_t j = 0; j < g; j++)
                    weighted_add(out + r * q_stride + j * d, scores + (r * g + j) * row + pos, vc,
                                 m, token_stride, d);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < g; j++) scale_head(out + r * q_stride + j * d, d, inv[r * g + j]);
}

#define TILE_ARGS                                                                             \
    const float *restrict q, int64_t q_stride, const float *restrict k_cache,                 \
        const float *restrict v_cache, const int32_t *restrict table, int64_t first,          \
        int64_t rows, int64_t bs, int64_t hkv, int64_t kvh, int64_t d, int64_t g, float scale, \
        float *restrict scores, float *restrict out
#define TILE_CALL(D)                                                                          \
    attend_tile(q, q_stride, k_cache, v_cache, table, first, rows, bs, hkv, kvh, D, g, scale, \
                scores, out)

static void tile_64(TILE_ARGS) { (void)d; TILE_CALL(64); }
static void tile_128(TILE_ARGS) { (void)d; TILE_CALL(128); }
static void tile_any(TILE_ARGS) { TILE_CALL(d); }

/* Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      const int32_t *query_start_loc, int64_t num_seqs, int64_t block_size,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                      float *out) {
    const int64_t g = num_q_heads / num_kv_heads;
    int64_t tiles = 0, max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = query_start_loc[b + 1] - query_start_loc[b];
        if (n > 1) {
            tiles += (n + TILE - 1) / TILE;
            if (seq_lens[b] > max_len) max_len = seq_lens[b];
        }
    }
    if (tiles == 0) return 0; /* decodes only: no thread team, no scratch */
    /* an item is (tile, KV head); its key: the tile's end position and the tile's index */
    int64_t *order = malloc(sizeof(int64_t) * tiles);
    int64_t *tile_seq = malloc(sizeof(int64_t) * tiles), *tile_start = malloc(sizeof(int64_t) * tiles);
    if (order == NULL || tile_seq == NULL || tile_start == NULL) {
        free(order), free(tile_seq), free(tile_start);
        return -1;
    }
    int64_t count = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = query_start_loc[b + 1] - query_start_loc[b];
        if (n <= 1) continue;
        for (int64_t t = 0; t < n; t += TILE) {
            const int64_t end = seq_lens[b] - n + (t + TILE < n ? t + TILE : n);
            tile_seq[count] = b, tile_start[count] = t;
            order[count] = end << 32 | count;
            count++;
        }
    }
    qsort(order, count, sizeof(int64_t), longest_first);
    void (*tile_d)(TILE_ARGS) = head_dim == 64 ? tile_64 : head_dim == 128 ? tile_128 : tile_any;
    const int64_t q_stride = num_q_heads * head_dim;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * TILE * g * ROW(max_len));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < count * num_kv_heads; item++) {
            if (scores == NULL) continue;
            const int64_t i = order[item / num_kv_heads] & 0xffffffff;
            const int64_t kvh = item % num_kv_heads, b = tile_seq[i], t = tile_start[i];
            const int64_t n = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t rows = n - t < TILE ? n - t : TILE;
            const int64_t offset =
                ((query_start_loc[b] + t) * num_q_heads + kvh * g) * head_dim;
            tile_d(q + offset, q_stride, k_cache, v_cache, block_tables + b * table_stride,
                   seq_lens[b] - n + t, rows, block_size, num_kv_heads, kvh, head_dim, g, scale,
                   scores, out + offset);
        }
        free(scores);
    }
    free(order), free(tile_seq), free(tile_start);
    return failed ? -1 : 0;
}
