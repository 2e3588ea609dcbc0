/* The boundary between Parrot's C ops (the .c files here) and Python, declared once.
 *
 * Every .c file includes this header, so the compiler checks each definition against
 * its prototype here (the build makes conflicting types, implicit declarations and
 * exported functions missing from this header errors: parrot/engine/kernels/native.py).  The
 * Python bindings are parsed from this file (parrot/engine/kernels/c_boundary.py): ctypes
 * argument and return types for every parrot_* prototype, ctypes.Structure fields for
 * every struct, whose layout the build checks against the compiler's.
 *
 * The parser reads a small subset of C; keep to it (it raises on anything else):
 *   - comments and preprocessor lines (#...) are skipped;
 *   - structs: `typedef struct { fields } Name;`, each field `[const] TYPE [*]name[, [*]name];`
 *   - functions: `RET parrot_name(PARAMS);` with PARAMS `void` or `[const] TYPE [*]name, ...`;
 *   - TYPE: void, int, int64_t, float, uint16_t or a struct above; by value only int,
 *     int64_t, float (and void as a return type); at most one `*`.
 *
 * Conventions: tensors are row-major and contiguous, shapes written [rows, cols];
 * "fp32 or bf16" data is `void *` with an int flag (bf16 as uint16 bit patterns,
 * rounded to nearest even like PyTorch's cast); every pointer is borrowed for the call
 * only (the caller owns all memory, nothing is kept after return) and index ranges
 * are the caller's to check; `threads` is the OpenMP thread count to use.
 */
#ifndef PARROT_OPS_H
#define PARROT_OPS_H

#include <stdint.h>

/* ------------------------------------------------ decode attention (decode_rows.c) */

/* Single-query rows: row r is query seqs[r] of q ([*, KVH * G, D] fp32, rows q_stride
 * floats apart, already scaled) over the cache rows tok[r * width .. + lens[r]) of k, v
 * ([N, KVH, D], fp32 or bf16 by kv_bf16).  Writes out [rows, KVH * G, D] (normalised)
 * and lse [rows, KVH * G].  Returns 1 when the AVX-512 path ran, 0 for portable C. */
int parrot_decode_rows(const float *q, int64_t q_stride, const int64_t *seqs, const void *k, const void *v,
                       int kv_bf16, const int64_t *tok, const int64_t *lens, int64_t rows, int64_t width,
                       int64_t kv_heads, int64_t group, int64_t dim, float *out, float *lse, int threads);

/* Exact merge of normalised partials: sequence b's partials are rows
 * slots[starts[b] .. starts[b + 1]) of out [S, H, D] and lse [S, H] (fp32);
 * result [batch, H, D] fp32, fully written. */
void parrot_merge_lse(const float *out, const float *lse, const int64_t *starts, const int64_t *slots,
                      int64_t batch, int64_t heads, int64_t dim, float *result, int threads);

/* ------------------------------------------- shared-prefix attention (shared_rows.c) */

/* 1 when the AVX-512 kernel runs head dim `dim` in this build (dim % 64 == 0; the engine
 * uses parrot_shared_rows only then); 0 when parrot_shared_rows runs the portable C. */
int parrot_shared_rows_supported(int64_t dim);

/* One shared run of n keys (cache rows tok[0 .. n) of k, v [N, KVH, D], fp32 or bf16)
 * read by the m queries seqs[0 .. m) of q (as in parrot_decode_rows).  Writes out
 * [m, KVH * G, D] and lse [m, KVH * G].  Returns 0 (every build and head dim computes);
 * 2 when scratch memory could not be allocated (nothing written). */
int parrot_shared_rows(const float *q, int64_t q_stride, const int64_t *seqs, int64_t m, const void *k,
                       const void *v, int kv_bf16, const int64_t *tok, int64_t n, int64_t kv_heads, int64_t group,
                       int64_t dim, float *out, float *lse, int threads);

/* -------------------------------------------- a decoder layer's steps (layer_ops.c) */

/* h += delta (unless delta is NULL; fp32 or bf16), then out = h / sqrt(mean(h^2) + eps)
 * * weight.  h [rows, dim] fp32 (updated in place), weight [dim] fp32, out [rows, dim]
 * fp32 or bf16. */
void parrot_add_rms_norm(float *h, const void *delta, int delta_bf16, const float *weight, float eps,
                         int64_t rows, int64_t dim, void *out, int out_bf16, int threads);

/* Rotary embedding in place on `heads` head vectors of `dim` floats per row, at
 * x + t * row_stride + head * dim; cos_t, sin_t [rows, dim] fp32 (HF layout). */
void parrot_rope(float *x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const float *cos_t,
                 const float *sin_t, int threads);

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: gu [rows, 2 * inter], out [rows, inter],
 * each fp32 or bf16. */
void parrot_silu_mul(const void *gu, int gu_bf16, int64_t rows, int64_t inter, void *out, int out_bf16,
                     int threads);

/* ------------------------------- bf16 linear at decode sizes (bf16_linear.c) */

/* The fastest backend of parrot_bf16_linear that may run here: 2 AMX tiles (built, and
 * Linux granted the tile state), 1 AVX-512 BF16 dot products (built), 0 portable C. */
int parrot_bf16_linear_best(void);

/* Elements (uint16) of the packed copy of an [n, k] weight. */
int64_t parrot_bf16_packed_size(int64_t n, int64_t k);

/* w [n, k] bf16 row-major into packed (parrot_bf16_packed_size(n, k) elements). */
void parrot_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed);

/* y [m, n] = x [m, k] W^T (+ bias [n] fp32, or NULL); x and y bf16 when x_bf16, else
 * fp32; packed from parrot_bf16_pack; computed by `backend` (numbered as
 * parrot_bf16_linear_best's).  Returns 0; 1 when that backend cannot run here (nothing
 * written); 2 when scratch memory could not be allocated (nothing written). */
int parrot_bf16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, void *y, int backend, int threads);

/* ------------------- prefill attention in bf16 dot products (prefill_bf16.c) */

/* The fastest backend of parrot_prefill_attention for heads of `dim` here: 2 AMX tiles
 * (built, tiles granted), 1 AVX-512 BF16 (built), both for dim % 32 == 0; else 0
 * portable C. */
int parrot_prefill_bf16_best(int64_t dim);

/* Causal attention of `chunks` prefill chunks over one layer's paged cache k, v
 * ([NB, BS, KVH, D] bf16): chunk c's queries are rows q_row[c] .. + n[c] of q ([T, KVH *
 * G, D] fp32, rows q_stride floats apart, unscaled) at positions start[c] ..; its keys
 * positions [0, start[c] + n[c]) in blocks blocks[blk_off[c] ..]; query i sees keys
 * <= start[c] + i.  Writes those rows of out (fp32, out_stride), softmax with `scale`,
 * computed by `backend` (numbered as parrot_prefill_bf16_best's).  Returns 0; 1 when
 * that backend cannot run here (nothing written); 2 when scratch memory could not be
 * allocated. */
int parrot_prefill_attention(const float *q, int64_t q_stride, const int64_t *q_row, const int64_t *n,
                             const int64_t *start, int64_t chunks, const uint16_t *k, const uint16_t *v,
                             const int64_t *blocks, const int64_t *blk_off, int64_t block_size, int64_t kv_heads,
                             int64_t group, int64_t dim, float scale, float *out, int64_t out_stride, int backend,
                             int threads);

/* ---------------------------------------------- fp32 linear, streamed (f32_linear.c) */

/* 1 when the AVX-512F kernel is built (the engine uses parrot_f32_linear only then);
 * 0 when parrot_f32_linear runs the portable C (the same bits, slower). */
int parrot_f32_linear_supported(void);

/* Elements (fp32) of the packed copy of an [n, k] weight. */
int64_t parrot_f32_packed_size(int64_t n, int64_t k);

/* w [n, k] fp32 row-major into packed (parrot_f32_packed_size(n, k) elements). */
void parrot_f32_pack(const float *w, int64_t n, int64_t k, float *packed);

/* y [m, n] = x [m, k] W^T (+ bias [n], or NULL), fp32; packed from parrot_f32_pack.
 * Returns 0 (every build computes). */
int parrot_f32_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                      float *y, int threads);

/* ------------------------------------------- a whole decode step (decode_forward.c) */

/* One layer's weights: norms [D] fp32; projections packed by parrot_f32_pack (fp32
 * weights) or parrot_bf16_pack (bf16 weights); the q/k/v bias [qkv columns] fp32 or NULL. */
typedef struct {
    const float *in_norm, *post_norm;
    float in_eps, post_eps;
    const void *qkv;
    const float *qkv_bias;
    const void *o, *gate_up, *down;
} ParrotDecodeLayer;

/* The step's sizes: T tokens, hidden D, heads, kv heads, head dim, MLP width; the
 * attention scale (1 / sqrt(head dim)); the final norm [D] fp32 and its eps; flags:
 * bf16 weights (parrot_bf16_linear, on backend bf16_backend), bf16 KV cache. */
typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, inter;
    float scale, final_eps;
    const float *final_norm;
    int weights_bf16, bf16_backend, kv_bf16;
} ParrotDecodeShape;

/* The step's attention plan as int64 index arrays.  Single-query rows r < rows: the
 * query of sequence row_seqs[r] over keys row_tok[r * width .. + row_lens[r]); shared
 * rows s < shared: the queries seqs[seq_off[s] .. seq_off[s + 1]) over keys
 * tok[tok_off[s] .. tok_off[s + 1]).  Partial slots (`slots` of them): the single rows
 * first, then each shared row's queries.  merge_starts [T + 1] / merge_slots: each
 * sequence's slots (CSR), or both NULL when slot b is sequence b's only one. */
typedef struct {
    int64_t rows, width;
    const int64_t *row_seqs, *row_tok, *row_lens;
    int64_t shared;
    const int64_t *seq_off, *seqs, *tok_off, *tok;
    int64_t slots;
    const int64_t *merge_starts, *merge_slots;
} ParrotDecodeAttention;

/* Every layer of one decode step (see decode_forward.c): layers [n_layers]; h [T, D]
 * fp32 the embedded tokens (the residual stream, updated in place); out [T, D] fp32 the
 * final hidden states; cos_t, sin_t [T, head dim]; k_cache, v_cache [layers][N, KVH,
 * head dim] (fp32 or bf16 by shape->kv_bf16), layers layer_stride elements apart;
 * slots [T] the new tokens' cache rows.  Returns 0; 1 when a kernel it needs is not
 * built or allowed here (nothing written); 2 when scratch memory could not be
 * allocated (possibly after some layers wrote their cache rows). */
int parrot_decode_forward(const ParrotDecodeLayer *layers, int64_t n_layers, const ParrotDecodeShape *shape,
                          float *h, float *out, const float *cos_t, const float *sin_t, void *k_cache,
                          void *v_cache, int64_t layer_stride, const int64_t *slots,
                          const ParrotDecodeAttention *plan, int threads);

#endif /* PARROT_OPS_H */
