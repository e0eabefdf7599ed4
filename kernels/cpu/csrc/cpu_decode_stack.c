/* A whole decode step of a Llama-family decoder on CPU in one call: the embedding, every layer
 * and the final norm. An fp32 model goes through the same kernels the model's torch code calls
 * one by one (panel_linear, rms_norm, rope, store_kv, decode_attention, silu_mul), in the same
 * order on the same values, so the hidden states are the same to the bit. A bf16 model (`bf16`:
 * bf16 embedding, panels from pack_panels_bf16, bf16 KV caches; norm weights and rope tables in
 * fp32) keeps its activations in fp32 inside the step: each projection's input rounded to bf16
 * for panel_linear_bf16 (fp32 out), the new K/V rounded to bf16 into the cache, attention over
 * the bf16 cache in fp32 -- close to the model's own bf16 steps, not the same bits. An fp32 model
 * quantized to int8 (`int8`: panels from pack_panels_int8) goes through panel_linear_int8 where
 * the fp32 one calls panel_linear, the rest unchanged: the same bits as its layer-by-layer steps;
 * so does one whose projections keep bf16 weights (`bf16_weights`: quantization bf16, panels from
 * pack_panels_bf16_weights) through panel_linear_bf16_weights.
 *
 * Why: a decode step streams the KV cache and the weights through the caches (tens of MB), and
 * each of the dozens of Python calls between the kernels then runs on a cold interpreter, several
 * times slower than on a warm one. Here there is none.
 *
 * Serves steps whose every sequence computes one token (T tokens = T sequences), with panels for
 * every projection (no biases); the caller checks (kernels/cpu/fast_path.py).
 * Per layer, with s the residual stream (x + residual, kept in `res`):
 *   x = rms_norm(h [+ res])                  the first layer: res = h
 *   qkv = x @ Wqkv.T                         [T, (Hq + 2 Hkv) D], rows q heads, k heads, v heads
 *   q/k heads = rms_norm(each head)          where the layer has q/k norm (Qwen3), in place
 *   rot = rope(q and k heads of qkv)         [T, Hq + Hkv, D]
 *   store_kv(rot's k heads, qkv's v heads)
 *   attn = decode_attention(rot's q heads)   [T, Hq D]
 *   x = rms_norm(attn @ Wo.T + res)
 *   h = silu_mul(x @ Wgate_up.T) @ Wdown.T
 * and last, hidden = rms_norm(h + res).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_kernels.h"
#include "cpu_vec.h"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *o, *gate_up, *down; /* panels (pack_panels, _bf16, _int8, _bf16_weights) */
    void *k_cache, *v_cache;              /* [num_blocks, block_size, Hkv, D], fp32 or bf16 */
    const float *q_norm, *k_norm;         /* [D] per-head q/k norm weights, or NULL (none) */
} stack_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_position, vocab, bf16, int8, bf16_weights;
    float eps, scale;
    const void *embed;       /* [vocab, hidden], fp32 or bf16 */
    const float *cos, *sin;  /* [max_position, D] rope tables (RotaryEmbedding's layout) */
    const float *final_norm; /* [hidden] */
    const stack_layer *layers;
} stack_model;

/* The step's activations, T rows each (see the per-layer steps above); for a bf16 model also
 * room for a row of bf16 (a projection's input, or a token's new K and V) per row. */
typedef struct {
    float *h, *res, *x, *qkv, *rot, *q, *attn, *gate_up, *act, *cos, *sin;
    uint16_t *rounded;
    int64_t rounded_width;
} stack_buffers;

/* One allocation for all of them (free(b->h)); -1 when it cannot allocate. */
static int alloc_buffers(const stack_model *m, int64_t T, stack_buffers *b) {
    const int64_t H = m->hidden, D = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    const int64_t I = m->intermediate, qkv_width = (hq + 2 * hkv) * D;
    const int64_t sizes[] = {T * H, T * H, T * H, T * qkv_width, T * (hq + hkv) * D,
                             T * hq * D, T * hq * D, T * 2 * I, T * I, T * D, T * D};
    float **slots[] = {&b->h, &b->res, &b->x, &b->qkv, &b->rot, &b->q, &b->attn, &b->gate_up,
                       &b->act, &b->cos, &b->sin};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
    float *p = malloc(sizeof(float) * (total > 0 ? total : 1));
    if (p == NULL) return -1;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) *slots[i] = p, p += sizes[i];
    b->rounded = NULL, b->rounded_width = 0;
    if (m->bf16) {
        int64_t width = H > hq * D ? H : hq * D;
        width = width > I ? width : I;
        width = width > 2 * hkv * D ? width : 2 * hkv * D;
        b->rounded_width = width;
        b->rounded = malloc(sizeof(uint16_t) * (T * width > 0 ? T * width : 1));
        if (b->rounded == NULL) {
            free(b->h);
            return -1;
        }
    }
    return 0;
}

static void free_buffers(stack_buffers *b) { free(b->h), free(b->rounded); }

/* n rows of `width` floats (rows `stride` apart) -> bf16 rows `width` apart in out, rounded to
 * nearest even. */
static void round_rows(const float *x, int64_t stride, int64_t n, int64_t width, uint16_t *out) {
    const int64_t wv = width - width % VW;
    for (int64_t t = 0; t < n; t++) {
        const float *src = x + t * stride;
        uint16_t *dst = out + t * width;
        for (int64_t i = 0; i < wv; i += VW) *(vh_mem *)(dst + i) = round_bf16(load(src + i));
        for (int64_t i = wv; i < width; i++) {
            float tail[VW] = {0};
            tail[0] = src[i];
            dst[i] = round_bf16(load(tail))[0];
        }
    }
}

/* out [n, N] fp32 = a [n, k] (rows k apart) @ W.T, W packed for the model's dtype (or int8, or
 * bf16 weights for an fp32 model);
 * `rounded` (room for n rows of k bf16) holds a rounded for a bf16 model. Returns 0 or -1. */
static int project(const stack_model *m, const float *a, int64_t n, int64_t k,
                   const void *panels, int64_t N, float *out, uint16_t *rounded) {
    if (m->int8) return panel_linear_int8(a, n, k, k, panels, N, out);
    if (m->bf16_weights) return panel_linear_bf16_weights(a, n, k, k, panels, N, out);
    if (!m->bf16) return panel_linear(a, n, k, k, panels, N, out);
    round_rows(a, k, n, k, rounded);
    return panel_linear_bf16(rounded, n, k, k, panels, N, out, NULL);
}

/* Rows [r0, r1): the embedding and their rope table rows. */
static void embed_rows(const stack_model *m, const stack_buffers *b, int64_t r0, int64_t r1,
                       const int64_t *ids, const int64_t *positions) {
    const int64_t H = m->hidden, D = m->head_dim;
    for (int64_t t = r0; t < r1; t++) {
        if (m->bf16) {
            const uint16_t *row = (const uint16_t *)m->embed + ids[t] * H;
            for (int64_t i = 0; i < H; i++) b->h[t * H + i] = bf16_to_float(row[i]);
        } else {
            memcpy(b->h + t * H, (const float *)m->embed + ids[t] * H, sizeof(float) * H);
        }
        memcpy(b->cos + t * D, m->cos + positions[t] * D, sizeof(float) * D);
        memcpy(b->sin + t * D, m->sin + positions[t] * D, sizeof(float) * D);
    }
}

/* Rows [r0, r1) of layer l up to attention: norm, qkv, RoPE, store_kv, q. Returns 0, -1 (could
 * not allocate) or -2 (a slot past the cache). */
static int before_attention(const stack_model *m, int64_t l, const stack_buffers *b, int64_t r0,
                            int64_t r1, const int64_t *slots) {
    const stack_layer *layer = m->layers + l;
    const int64_t n = r1 - r0, H = m->hidden, D = m->head_dim;
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads;
    const int64_t qkv_width = (hq + 2 * hkv) * D, rot_width = (hq + hkv) * D;
    float *h = b->h + r0 * H, *res = b->res + r0 * H, *x = b->x + r0 * H;
    float *qkv = b->qkv + r0 * qkv_width, *rot = b->rot + r0 * rot_width;
    uint16_t *rounded = m->bf16 ? b->rounded + r0 * b->rounded_width : NULL; /* NULL: fp32 */
    if (l == 0) {
        rms_norm(h, H, NULL, layer->input_norm, m->eps, n, H, x, NULL);
        memcpy(res, h, sizeof(float) * n * H);
    } else {
        rms_norm(h, H, res, layer->input_norm, m->eps, n, H, x, res);
    }
    if (project(m, x, n, H, layer->qkv, qkv_width, qkv, rounded) != 0) return -1;
    if (layer->q_norm != NULL) /* each head a row of D, in place: a row is read before written */
        for (int64_t t = 0; t < n; t++) {
            float *q_heads = qkv + t * qkv_width, *k_heads = q_heads + hq * D;
            rms_norm(q_heads, D, NULL, layer->q_norm, m->eps, hq, D, q_heads, NULL);
            rms_norm(k_heads, D, NULL, layer->k_norm, m->eps, hkv, D, k_heads, NULL);
        }
    rope(qkv, qkv_width, D, n, hq + hkv, D, b->cos + r0 * D, b->sin + r0 * D, rot);
    const int64_t kv = hkv * D, capacity = m->num_blocks * m->block_size;
    int stored;
    if (m->bf16) { /* each row: its k, then its v, rounded */
        round_rows(rot + hq * D, rot_width, n, kv, rounded);
        round_rows(qkv + rot_width, qkv_width, n, kv, rounded + n * kv);
        stored = store_kv_bf16(rounded, kv, rounded + n * kv, kv, slots + r0, n, kv, capacity,
                               layer->k_cache, layer->v_cache);
    } else {
        stored = store_kv(rot + hq * D, rot_width, qkv + rot_width, qkv_width, slots + r0, n, kv,
                          capacity, layer->k_cache, layer->v_cache);
    }
    if (stored != 0) return -2;
    for (int64_t t = 0; t < n; t++)
        memcpy(b->q + (r0 + t) * hq * D, rot + t * rot_width, sizeof(float) * hq * D);
    return 0;
}

/* Rows [r0, r1) of layer l after attention: o_proj, norm, the MLP. Returns 0 or -1. */
static int after_attention(const stack_model *m, int64_t l, const stack_buffers *b, int64_t r0,
                           int64_t r1) {
    const stack_layer *layer = m->layers + l;
    const int64_t n = r1 - r0, H = m->hidden, I = m->intermediate;
    const int64_t hqd = m->num_heads * m->head_dim;
    float *h = b->h + r0 * H, *res = b->res + r0 * H, *x = b->x + r0 * H;
    float *gate_up = b->gate_up + r0 * 2 * I, *act = b->act + r0 * I;
    uint16_t *rounded = m->bf16 ? b->rounded + r0 * b->rounded_width : NULL; /* NULL: fp32 */
    if (project(m, b->attn + r0 * hqd, n, hqd, layer->o, H, h, rounded) != 0) return -1;
    rms_norm(h, H, res, layer->post_norm, m->eps, n, H, x, res);
    if (project(m, x, n, H, layer->gate_up, 2 * I, gate_up, rounded) != 0) return -1;
    silu_mul(gate_up, n, I, act);
    return project(m, act, n, I, layer->down, H, h, rounded) != 0 ? -1 : 0;
}

/* Rows [r0, r1) through every layer and the final norm into hidden. In a team (`order`: the
 * decode rows' order, decode_order), every thread of the enclosing region calls this with its own
 * rows, and each layer's attention over all rows is shared out among them between two barriers;
 * alone (`order` NULL), attention runs in a region of its own. A thread whose work failed goes on
 * meeting the others at every barrier. Returns 0 or the first error (see decode_stack). */
static int run_layers(const stack_model *m, const stack_buffers *b, int64_t T, int64_t r0,
                      int64_t r1, const int64_t *ids, const int64_t *positions,
                      const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                      const int32_t *seq_lens, const int32_t *query_start_loc,
                      const int64_t *order, int64_t count, int64_t max_len, float *hidden) {
    const int64_t H = m->hidden, hq = m->num_heads, hkv = m->num_kv_heads, D = m->head_dim;
    const int rows = r0 < r1;
    int status = 0;
    if (rows) embed_rows(m, b, r0, r1, ids, positions);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const stack_layer *layer = m->layers + l;
        if (status == 0 && rows) status = before_attention(m, l, b, r0, r1, slots);
        int failed = 0;
        if (order != NULL) {
#pragma omp barrier
            failed = decode_attention_team(b->q, layer->k_cache, layer->v_cache, (int)m->bf16,
                                           block_tables,
                                           table_stride, seq_lens, query_start_loc,
                                           m->block_size, hq, hkv, D, m->scale, order, count,
                                           max_len, b->attn);
        } else if (status == 0 && m->bf16) {
            failed = decode_attention_bf16(b->q, layer->k_cache, layer->v_cache, block_tables,
                                           table_stride, seq_lens, query_start_loc, T,
                                           m->block_size, hq, hkv, D, m->scale, b->attn);
        } else if (status == 0) {
            failed = decode_attention(b->q, layer->k_cache, layer->v_cache, block_tables,
                                      table_stride, seq_lens, query_start_loc, T, m->block_size,
                                      hq, hkv, D, m->scale, b->attn);
        }
        if (failed && status == 0) status = -1;
        if (status == 0 && rows) status = after_attention(m, l, b, r0, r1);
    }
    if (status == 0 && rows)
        rms_norm(b->h + r0 * H, H, b->res + r0 * H, m->final_norm, m->eps, r1 - r0, H,
                 hidden + r0 * H, b->res + r0 * H);
    return status;
}

/* Where thread k's rows begin, bounds[0 .. parts]: as even as whole row blocks of ROW_ALIGN (the
 * panel GEMM's) allow. */
#define ROW_ALIGN 8
#define MIN_ROWS_PER_THREAD 16 /* fewer: each kernel shares its own work out (see decode_stack) */
static void split_rows(int64_t T, int parts, int64_t *bounds) {
    const int64_t blocks = (T + ROW_ALIGN - 1) / ROW_ALIGN;
    for (int k = 0; k <= parts; k++) {
        const int64_t b = blocks * k / parts * ROW_ALIGN;
        bounds[k] = b < T ? b : T;
    }
}

/* ids, positions, slots [T] int64; block_tables [T, table_stride], seq_lens [T], query_start_loc
 * [T + 1] int32 (one token per sequence); hidden [T, hidden] out.
 *
 * With MIN_ROWS_PER_THREAD rows or more for each OpenMP thread, the step is one parallel region:
 * each thread takes a contiguous range of rows (split_rows) through the row-wise work of every
 * layer on its own (the kernels it calls run on it alone: a parallel region inside another runs
 * with one thread), and attention is shared out by sequence, longest first, between two
 * barriers. A layer then costs two barriers instead of a fork and a join per kernel, and a row's
 * activations stay on the core that computes them, where each kernel used to share its work out
 * its own way (the GEMMs by columns, attention by sequence, the norms by rows) and hand the rows
 * over between the cores, which at decode sizes barely gained on one core doing it all. With
 * few rows a thread, each thread reading every weight costs more than the barriers save, so
 * below MIN_ROWS_PER_THREAD each kernel shares its calls out as alone. Every kernel computes a
 * row on its own, so each row gets the same result, to the bit, either way.
 * Returns 0; -1 when a scratch buffer could not be allocated; -2 when a slot lies past the cache;
 * -3 for a position past the rope tables; -4 for a token id past the vocabulary. On an error
 * `hidden` and the cache are incomplete. */
int decode_stack(const stack_model *m, int64_t tokens, const int64_t *ids,
                 const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                 float *hidden) {
    const int64_t T = tokens;
    for (int64_t t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= m->max_position) return -3;
        if (ids[t] < 0 || ids[t] >= m->vocab) return -4;
    }
    int parts = 1;
#ifdef _OPENMP
    parts = omp_get_max_threads();
#endif
    stack_buffers b;
    if (alloc_buffers(m, T, &b) != 0) return -1;
    int status = 0;
    if (parts < 2 || T < MIN_ROWS_PER_THREAD * parts) {
        status = run_layers(m, &b, T, 0, T, ids, positions, slots, block_tables, table_stride,
                            seq_lens, query_start_loc, NULL, 0, 0, hidden);
        free_buffers(&b);
        return status;
    }
    int64_t count, max_len, bounds[parts + 1];
    int64_t *order = decode_order(seq_lens, query_start_loc, T, &count, &max_len);
    if (order == NULL) {
        free_buffers(&b);
        return -1;
    }
    split_rows(T, parts, bounds);
#pragma omp parallel num_threads(parts) reduction(min : status)
    {
        int k = 0, team = 1;
#ifdef _OPENMP
        k = omp_get_thread_num(), team = omp_get_num_threads();
#endif
        int64_t r0 = bounds[k], r1 = bounds[k + 1];
        if (team < parts) r0 = k == 0 ? 0 : T, r1 = T; /* a smaller team: the first takes all */
        status = run_layers(m, &b, T, r0, r1, ids, positions, slots, block_tables, table_stride,
                            seq_lens, query_start_loc, order, count, max_len, hidden);
    }
    free(order);
    free_buffers(&b);
    return status;
}
