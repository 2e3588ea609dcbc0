/* A whole fp32 decode step of the decoder's layers in one call (CPU).
 *
 * The same sequence of C ops that the model's fused Python forward makes layer by
 * layer (parrot/engine/model.py _forward_fused with the paged decode attention of
 * parrot/engine/attention/torch_impl.py on the C kernels), with nothing between
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
 * Inputs: h [T, D] the embedded tokens (the residual stream, updated in place);
 * out [T, D] the final hidden states; the caches as [layers][N, KVH, Dh] fp32 rows,
 * `layer_stride` floats apart; the attention plan's index arrays, whose ranges the
 * caller (parrot/engine/decode_forward.py) has checked.  Returns 0, 1 when a kernel
 * this needs is not built here (nothing written), 2 when scratch memory could not be
 * allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int parrot_f32_linear_supported(void);
int parrot_f32_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                      float *y, int threads);
int parrot_shared_rows_supported(int64_t dim);
int parrot_decode_rows(const float *q, int64_t q_stride, const int64_t *seqs, const void *k, const void *v,
                       int kv_bf16, const int64_t *tok, const int64_t *lens, int64_t rows, int64_t width,
                       int64_t kv_heads, int64_t group, int64_t dim, float *out, float *lse, int threads);
int parrot_shared_rows(const float *q, int64_t q_stride, const int64_t *seqs, int64_t m, const void *k,
                       const void *v, int kv_bf16, const int64_t *tok, int64_t n, int64_t kv_heads, int64_t group,
                       int64_t dim, float *out, float *lse, int threads);
void parrot_merge_lse(const float *out, const float *lse, const int64_t *starts, const int64_t *slots,
                      int64_t batch, int64_t heads, int64_t dim, float *result, int threads);
void parrot_add_rms_norm(float *h, const void *delta, int delta_bf16, const float *weight, float eps,
                         int64_t rows, int64_t dim, void *out, int out_bf16, int threads);
void parrot_rope(float *x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const float *cos_t,
                 const float *sin_t, int threads);
void parrot_silu_mul(const void *gu, int gu_bf16, int64_t rows, int64_t inter, void *out, int out_bf16,
                     int threads);

/* One layer's weights: norms [D], projections packed by parrot_f32_pack. */
typedef struct {
    const float *in_norm, *post_norm;
    float in_eps, post_eps;
    const float *qkv, *qkv_bias, *o, *gate_up, *down;
} ParrotDecodeLayer;

typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, inter;
    float scale, final_eps;
    const float *final_norm;
} ParrotDecodeShape;

/* Single-query rows r < rows: the query of sequence row_seqs[r] over keys
 * row_tok[r * width .. + row_lens[r]); shared rows s < shared: the queries seqs[seq_off[s]
 * .. seq_off[s + 1]) over keys tok[tok_off[s] .. tok_off[s + 1]).  Partial slots: the
 * single rows first, then each shared row's queries.  merge_starts / merge_slots: each
 * sequence's slots (CSR), or NULL when slot b is sequence b's only one (direct). */
typedef struct {
    int64_t rows, width;
    const int64_t *row_seqs, *row_tok, *row_lens;
    int64_t shared;
    const int64_t *seq_off, *seqs, *tok_off, *tok;
    int64_t slots;
    const int64_t *merge_starts, *merge_slots;
} ParrotDecodeAttention;

int parrot_decode_forward(const ParrotDecodeLayer *layers, int64_t n_layers, const ParrotDecodeShape *shape,
                          float *h, float *out, const float *cos_t, const float *sin_t, float *k_cache,
                          float *v_cache, int64_t layer_stride, const int64_t *slots,
                          const ParrotDecodeAttention *plan, int threads) {
    const int64_t t = shape->tokens, d = shape->hidden, heads = shape->heads, kvh = shape->kv_heads;
    const int64_t dh = shape->head_dim, inter = shape->inter, qkv_n = (heads + 2 * kvh) * dh;
    const int64_t group = heads / kvh, hd = heads * dh;
    if (!parrot_f32_linear_supported() || (plan->shared && !parrot_shared_rows_supported(dh))) return 1;
    const size_t floats = (size_t)(t * d + t * qkv_n + t * hd + plan->slots * hd + plan->slots * heads + t * hd +
                                   t * 2 * inter + t * inter + t * d);
    float *mem = malloc(sizeof(float) * floats);
    if (!mem) return 2;
    float *x = mem, *qkv = x + t * d, *qs = qkv + t * qkv_n, *pout = qs + t * hd, *plse = pout + plan->slots * hd;
    float *attn = plse + plan->slots * heads, *gu = attn + t * hd, *act = gu + t * 2 * inter, *mo = act + t * inter;
    /* With one partial per sequence in batch order the partials are the output. */
    float *merged = plan->merge_starts ? attn : pout;
    parrot_add_rms_norm(h, NULL, 0, layers[0].in_norm, layers[0].in_eps, t, d, x, 0, threads);
    for (int64_t l = 0; l < n_layers; l++) {
        const ParrotDecodeLayer *ly = &layers[l];
        float *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        parrot_f32_linear(x, t, d, ly->qkv, qkv_n, ly->qkv_bias, qkv, threads);
        parrot_rope(qkv, t, heads + kvh, dh, qkv_n, cos_t, sin_t, threads);
        for (int64_t i = 0; i < t; i++) {
            memcpy(kc + slots[i] * kvh * dh, qkv + i * qkv_n + hd, sizeof(float) * kvh * dh);
            memcpy(vc + slots[i] * kvh * dh, qkv + i * qkv_n + hd + kvh * dh, sizeof(float) * kvh * dh);
            for (int64_t j = 0; j < hd; j++) qs[i * hd + j] = qkv[i * qkv_n + j] * shape->scale;
        }
        if (plan->rows)
            parrot_decode_rows(qs, hd, plan->row_seqs, kc, vc, 0, plan->row_tok, plan->row_lens, plan->rows,
                               plan->width, kvh, group, dh, pout, plse, threads);
        int64_t slot = plan->rows;
        for (int64_t s = 0; s < plan->shared; s++) {
            const int64_t m = plan->seq_off[s + 1] - plan->seq_off[s];
            const int code = parrot_shared_rows(qs, hd, plan->seqs + plan->seq_off[s], m, kc, vc, 0,
                                                plan->tok + plan->tok_off[s], plan->tok_off[s + 1] - plan->tok_off[s],
                                                kvh, group, dh, pout + slot * hd, plse + slot * heads, threads);
            if (code) {
                free(mem);
                return code;
            }
            slot += m;
        }
        if (plan->merge_starts)
            parrot_merge_lse(pout, plse, plan->merge_starts, plan->merge_slots, t, heads, dh, attn, threads);
        parrot_f32_linear(merged, t, hd, ly->o, d, NULL, mo, threads);
        parrot_add_rms_norm(h, mo, 0, ly->post_norm, ly->post_eps, t, d, x, 0, threads);
        parrot_f32_linear(x, t, d, ly->gate_up, 2 * inter, NULL, gu, threads);
        parrot_silu_mul(gu, 0, t, inter, act, 0, threads);
        parrot_f32_linear(act, t, inter, ly->down, d, NULL, mo, threads);
        const int last = l + 1 == n_layers;
        parrot_add_rms_norm(h, mo, 0, last ? shape->final_norm : layers[l + 1].in_norm,
                            last ? shape->final_eps : layers[l + 1].in_eps, t, d, last ? out : x, 0, threads);
    }
    free(mem);
    return 0;
}
