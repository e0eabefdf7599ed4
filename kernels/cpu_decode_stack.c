/* A whole decode step of a Llama-family decoder on CPU, fp32, in one call: the embedding, every
 * layer and the final norm, through the same kernels the model's torch code calls one by one
 * (panel_linear, rms_norm, rope, store_kv, decode_attention, silu_mul), in the same order on the
 * same values, so the hidden states are the same to the bit.
 *
 * Why: a decode step streams the KV cache and the weights through the caches (tens of MB), and
 * each of the ~50 Python calls between the kernels then runs on a cold interpreter, 3-15x slower
 * than on a warm one: about a millisecond of a 12 ms step at 64 sequences. Here there is none.
 *
 * Serves steps whose every sequence computes one token (T tokens = T sequences), with panels for
 * every projection (no biases) and no q/k norm; the caller checks (kernels/cpu.py DecodeStack).
 * Per layer, with s the residual stream (x + residual, kept in `res`):
 *   x = rms_norm(h [+ res])                  the first layer: res = h
 *   qkv = x @ Wqkv.T                         [T, (Hq + 2 Hkv) D], rows q heads, k heads, v heads
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

#include "cpu_kernels.h"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *qkv, *o, *gate_up, *down; /* panels (pack_panels) */
    float *k_cache, *v_cache;              /* [num_blocks, block_size, Hkv, D] */
} stack_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_position, vocab;
    float eps, scale;
    const float *embed;      /* [vocab, hidden] */
    const float *cos, *sin;  /* [max_position, D] rope tables (RotaryEmbedding's layout) */
    const float *final_norm; /* [hidden] */
    const stack_layer *layers;
} stack_model;

/* ids, positions, slots [T] int64; block_tables [T, table_stride], seq_lens [T], query_start_loc
 * [T + 1] int32 (one token per sequence); hidden [T, hidden] out.
 * Returns 0; -1 when a scratch buffer could not be allocated; -2 when a slot lies past the cache;
 * -3 for a position past the rope tables; -4 for a token id past the vocabulary. On an error
 * `hidden` and the cache are incomplete. */
int decode_stack(const stack_model *m, int64_t tokens, const int64_t *ids,
                 const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                 float *hidden) {
    const int64_t T = tokens, H = m->hidden, D = m->head_dim;
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads, I = m->intermediate;
    const int64_t qkv_width = (hq + 2 * hkv) * D, rot_width = (hq + hkv) * D;
    for (int64_t t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= m->max_position) return -3;
        if (ids[t] < 0 || ids[t] >= m->vocab) return -4;
    }
    const int64_t sizes[] = {T * H, T * H, T * H, T * qkv_width, T * rot_width,
                             T * hq * D, T * hq * D, T * 2 * I, T * I, T * D, T * D};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
    float *scratch = malloc(sizeof(float) * (total > 0 ? total : 1));
    if (scratch == NULL) return -1;
    float *h = scratch, *res = h + T * H, *x = res + T * H, *qkv = x + T * H;
    float *rot = qkv + T * qkv_width, *q = rot + T * rot_width, *attn = q + T * hq * D;
    float *gate_up = attn + T * hq * D, *act = gate_up + T * 2 * I, *cos = act + T * I;
    float *sin = cos + T * D;

    for (int64_t t = 0; t < T; t++) {
        memcpy(h + t * H, m->embed + ids[t] * H, sizeof(float) * H);
        memcpy(cos + t * D, m->cos + positions[t] * D, sizeof(float) * D);
        memcpy(sin + t * D, m->sin + positions[t] * D, sizeof(float) * D);
    }
    int status = 0;
    for (int64_t l = 0; l < m->num_layers && status == 0; l++) {
        const stack_layer *layer = m->layers + l;
        if (l == 0) {
            rms_norm(h, H, NULL, layer->input_norm, m->eps, T, H, x, NULL);
            memcpy(res, h, sizeof(float) * T * H);
        } else {
            rms_norm(h, H, res, layer->input_norm, m->eps, T, H, x, res);
        }
        if (panel_linear(x, T, H, H, layer->qkv, qkv_width, qkv) != 0) {
            status = -1;
            break;
        }
        rope(qkv, qkv_width, D, T, hq + hkv, D, cos, sin, rot);
        if (store_kv(rot + hq * D, rot_width, qkv + rot_width, qkv_width, slots, T, hkv * D,
                     m->num_blocks * m->block_size, layer->k_cache, layer->v_cache) != 0) {
            status = -2;
            break;
        }
        for (int64_t t = 0; t < T; t++)
            memcpy(q + t * hq * D, rot + t * rot_width, sizeof(float) * hq * D);
        if (decode_attention(q, layer->k_cache, layer->v_cache, block_tables, table_stride,
                             seq_lens, query_start_loc, T, m->block_size, hq, hkv, D, m->scale,
                             attn) != 0 ||
            panel_linear(attn, T, hq * D, hq * D, layer->o, H, h) != 0) {
            status = -1;
            break;
        }
        rms_norm(h, H, res, layer->post_norm, m->eps, T, H, x, res);
        if (panel_linear(x, T, H, H, layer->gate_up, 2 * I, gate_up) != 0) {
            status = -1;
            break;
        }
        silu_mul(gate_up, T, I, act);
        if (panel_linear(act, T, I, I, layer->down, H, h) != 0) status = -1;
    }
    if (status == 0) rms_norm(h, H, res, m->final_norm, m->eps, T, H, hidden, res);
    free(scratch);
    return status;
}
