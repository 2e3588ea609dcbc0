/* A whole decode step of the decoder's layers in one call (CPU).
 *
 * The same sequence of C ops that the model's fused Python forward makes layer by
 * layer (parrot/engine/model.py _forward_fused with the paged decode attention of
 * parrot/engine/kernels/attention/torch_impl.py on the C kernels), with nothing between
 * them: per layer
 *
 *   qkv = x W_qkv (+ bias); RoPE on q and k; k, v rows written to the cache at
 *   slots; qs = q * scale; single-query rows (decode_rows) and shared rows
 *   (shared_rows) into partials; partials merged (merge_lse) unless every
 *   sequence has exactly its own one; a = attn W_o; h += a, x = norm(h);
 *   gu = x W_gate_up; act = silu(gate) * up; m = act W_down; h += m, x = norm(h)
 *   (the next layer's input norm, or the final norm after the last layer).
 *
 * Each op is the library's own function, called with the same arguments and in the
 * same order as from Python, so the result is the same bits as the Python path.
 * Weights are fp32 panels (parrot_f32_linear) or, with `weights_bf16`, bf16 blocks
 * (parrot_bf16_linear on the shape's backend), and then the MLP runs in bf16 from its
 * norm to the residual add, as in Python; the KV cache is fp32 or, with `kv_bf16`, bf16 (new rows rounded
 * to nearest even, like PyTorch's conversion).
 * Inputs: h [T, D] the embedded tokens (the residual stream, updated in place);
 * out [T, D] the final hidden states; the caches as [layers][N, KVH, Dh] rows,
 * `layer_stride` elements apart; the attention plan's index arrays, whose ranges the
 * caller (parrot/engine/kernels/decode_forward.py) has checked.  Returns 0; 1 when a kernel
 * this needs is not built or allowed here (checked first: nothing written); 2 when
 * scratch memory could not be allocated (possibly part-way, after some layers wrote
 * their cache rows: the caller fails the step, and a redone step rewrites them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parrot_ops.h"

/* PyTorch's fp32 -> bf16 conversion: round to nearest even, NaN to the canonical NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* y = x W (+ bias) through the weights' kernel; x and y are bf16 where the flags say. */
static int linear(const ParrotDecodeShape *s, const void *x, int x_bf16, int64_t m, int64_t k, const void *w,
                  int64_t n, const float *bias, void *y, int threads) {
    if (s->weights_bf16)
        return parrot_bf16_linear(x, x_bf16, m, k, (const uint16_t *)w, n, bias, y, s->bf16_backend, threads);
    return parrot_f32_linear((const float *)x, m, k, (const float *)w, n, bias, (float *)y, threads);
}

/* The new tokens' k and v rows (heads [H, H + KVH) and [H + KVH, H + 2 KVH) of each
 * qkv row) into the layer's cache rows at `slots`. */
static void write_kv(const float *qkv, int64_t t, int64_t qkv_n, int64_t hd, int64_t row, const int64_t *slots,
                     void *kc, void *vc, int bf16) {
    for (int64_t i = 0; i < t; i++) {
        const float *k = qkv + i * qkv_n + hd, *v = k + row;
        if (!bf16) {
            memcpy((float *)kc + slots[i] * row, k, sizeof(float) * row);
            memcpy((float *)vc + slots[i] * row, v, sizeof(float) * row);
            continue;
        }
        uint16_t *kd = (uint16_t *)kc + slots[i] * row, *vd = (uint16_t *)vc + slots[i] * row;
        for (int64_t j = 0; j < row; j++) kd[j] = to_bf16(k[j]), vd[j] = to_bf16(v[j]);
    }
}

int parrot_decode_forward(const ParrotDecodeLayer *layers, int64_t n_layers, const ParrotDecodeShape *shape,
                          float *h, float *out, const float *cos_t, const float *sin_t, void *k_cache,
                          void *v_cache, int64_t layer_stride, const int64_t *slots,
                          const ParrotDecodeAttention *plan, int threads) {
    const int64_t t = shape->tokens, d = shape->hidden, heads = shape->heads, kvh = shape->kv_heads;
    const int64_t dh = shape->head_dim, inter = shape->inter, qkv_n = (heads + 2 * kvh) * dh;
    const int64_t group = heads / kvh, hd = heads * dh;
    const int wb = shape->weights_bf16, kb = shape->kv_bf16, esize = kb ? 2 : 4;
    if (wb ? shape->bf16_backend < 1 || shape->bf16_backend > parrot_bf16_linear_best()
           : !parrot_f32_linear_supported())
        return 1;
    if (plan->shared && !parrot_shared_rows_supported(dh)) return 1;
    const size_t floats = (size_t)(t * d + t * d + t * qkv_n + t * hd + plan->slots * hd + plan->slots * heads +
                                   t * hd + t * 2 * inter + t * inter + t * d);
    float *mem = malloc(sizeof(float) * floats);
    if (!mem) return 2;
    /* x: an attention input (fp32); xm: an MLP input (bf16 with bf16 weights) */
    float *x = mem, *xm = x + t * d, *qkv = xm + t * d, *qs = qkv + t * qkv_n, *pout = qs + t * hd;
    float *plse = pout + plan->slots * hd, *attn = plse + plan->slots * heads, *gu = attn + t * hd;
    float *act = gu + t * 2 * inter, *mo = act + t * inter;
    /* With one partial per sequence in batch order the partials are the output. */
    float *merged = plan->merge_starts ? attn : pout;
    int code = 0;
    parrot_add_rms_norm(h, NULL, 0, layers[0].in_norm, layers[0].in_eps, t, d, x, 0, threads);
    for (int64_t l = 0; l < n_layers && !code; l++) {
        const ParrotDecodeLayer *ly = &layers[l];
        char *kc = (char *)k_cache + l * layer_stride * esize, *vc = (char *)v_cache + l * layer_stride * esize;
        if ((code = linear(shape, x, 0, t, d, ly->qkv, qkv_n, ly->qkv_bias, qkv, threads))) break;
        parrot_rope(qkv, t, heads + kvh, dh, qkv_n, cos_t, sin_t, threads);
        write_kv(qkv, t, qkv_n, hd, kvh * dh, slots, kc, vc, kb);
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < hd; j++) qs[i * hd + j] = qkv[i * qkv_n + j] * shape->scale;
        if (plan->rows)
            parrot_decode_rows(qs, hd, plan->row_seqs, kc, vc, kb, plan->row_tok, plan->row_lens, plan->rows,
                               plan->width, kvh, group, dh, pout, plse, threads);
        int64_t slot = plan->rows;
        for (int64_t s = 0; s < plan->shared && !code; s++) {
            const int64_t m = plan->seq_off[s + 1] - plan->seq_off[s];
            code = parrot_shared_rows(qs, hd, plan->seqs + plan->seq_off[s], m, kc, vc, kb,
                                      plan->tok + plan->tok_off[s], plan->tok_off[s + 1] - plan->tok_off[s], kvh,
                                      group, dh, pout + slot * hd, plse + slot * heads, threads);
            slot += m;
        }
        if (code) break;
        if (plan->merge_starts)
            parrot_merge_lse(pout, plse, plan->merge_starts, plan->merge_slots, t, heads, dh, attn, threads);
        if ((code = linear(shape, merged, 0, t, hd, ly->o, d, NULL, mo, threads))) break;
        parrot_add_rms_norm(h, mo, 0, ly->post_norm, ly->post_eps, t, d, xm, wb, threads);
        if ((code = linear(shape, xm, wb, t, d, ly->gate_up, 2 * inter, NULL, gu, threads))) break;
        parrot_silu_mul(gu, wb, t, inter, act, wb, threads);
        if ((code = linear(shape, act, wb, t, inter, ly->down, d, NULL, mo, threads))) break;
        const int last = l + 1 == n_layers;
        parrot_add_rms_norm(h, mo, wb, last ? shape->final_norm : layers[l + 1].in_norm,
                            last ? shape->final_eps : layers[l + 1].in_eps, t, d, last ? out : x, 0, threads);
    }
    free(mem);
    return code;
}
