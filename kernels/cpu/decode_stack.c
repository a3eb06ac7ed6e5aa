/* A decode step's decoder layers in one call: the per-layer work of model/llama.py's C-kernel
 * path, in the same order with the same kernels, without returning to Python between them.
 *
 * At decode sizes a layer's arithmetic takes tens of microseconds and its dozen Python-level
 * operations (wrappers, argument checks, tensor allocations, ctypes calls) about as much
 * again; on a 12-layer model that is a millisecond of a 3-5 ms INT4 step. Here the layer loop
 * runs in C and calls the kernels of the other libraries (fused.c, paged_attention.c,
 * gemv_bf16.c, gemv_int4.c) through function pointers the caller resolves once, so each
 * library keeps its own build flags and this file holds only the glue:
 *
 *   for each layer:
 *     h   = rms_norm(x, input_layernorm)                          pd_rms_norm
 *     qkv = linear(h, qkv_proj) [+ bias]                          bf16 packed or INT4 kernel
 *     q   = rope(qkv) [q/k norm]; cache[slot] = (rope(k), v)       pd_rope_write_kv
 *     a   = attention(q, cache) -> element type                   pd_paged_attention
 *     x   = x + linear(a, o_proj) [+ bias]
 *     h   = rms_norm(x, post_attention_layernorm)
 *     x   = x + linear(silu(gate) * up, down_proj) [+ biases]     pd_silu_mul between
 *           or, a mixture of experts: x + moe(h)                  moe_mlp (moe_mlp.h)
 *   out = rms_norm(x, norm)
 *
 * Every rounding is the torch code's: element-wise sums round once to the element type,
 * a bias is added to the rounded product (in float32 if the bias is float32, as torch's
 * type promotion does), the float32 attention output is rounded to the element type before
 * o_proj. So the hidden states are bit-identical to the per-operation C-kernel path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "sample_row.h"

typedef int (*bf16_linear_fn)(const void *x, int64_t M, int64_t K, int64_t ldx, const void *wp, int64_t Np,
                              int64_t n_valid, void *y, int64_t ldy);
typedef int (*int4_linear_fn)(const void *x, int x_bf16, int64_t M, int64_t K, int64_t ldx, int64_t Kp, int64_t G,
                              const void *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                              void *y, int y_bf16, int64_t ldy);
typedef void (*rms_norm_fn)(const void *x, const void *w, void *out, int64_t n, int64_t dim, int64_t ldx,
                            int64_t ldo, float eps, int bf16);
typedef void (*rope_write_kv_fn)(const void *qkv, int64_t n, int64_t ld, int64_t H, int64_t Hkv, int64_t D,
                                 const float *cos_t, const float *sin_t, void *q_out, int q_elem, void *cache,
                                 int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v, const int64_t *slots,
                                 int64_t block_size, int bf16, const void *q_norm_w, const void *k_norm_w, float eps);
typedef int (*attention_fn)(const float *q, float *out, int64_t H, int64_t Hkv, int64_t D, const int32_t *qs,
                            const int32_t *seq_lens, int64_t B, const void *cache, int bf16, int64_t s_block,
                            int64_t s_tok, int64_t s_head, int64_t s_v, const int32_t *tables, int64_t max_blocks,
                            int64_t block_size, float scale);
typedef void (*silu_mul_fn)(const void *gate_up, int64_t n, int64_t inter, int64_t ld, void *out, int bf16);
typedef void (*argmax_fn)(const float *x, int64_t n, int64_t vocab, int64_t ld, int64_t *out);

enum { LINEAR_BF16 = 0, LINEAR_INT4 = 1 };

/* One projection. BF16: w = packed [Np/16][K/2][16][2] (gemv_bf16.c); steps of at most
 * gemv_max_rows rows take the gemv, others AMX tiles if amx, else the AVX512-BF16 gemm.
 * INT4: w = wq, sc / zc = scales and z - 8 s (gemv_int4.c), Kp and G its padded width and group.
 * bias: [N] float32 (bias_bf16 = 0) or bf16, or NULL. */
typedef struct {
    int32_t kind, amx, bias_bf16, gemv_max_rows;
    const void *w;
    const float *sc, *zc;
    int64_t N, Np, K, Kp, G;
    const void *bias;
} Linear;

/* A mixture of experts in a layer's MLP's place (model/moe.py): the router [E, hidden] and each expert's
 * gate_up [2 inter, hidden] and down [hidden, inter] (arrays of num_experts); top_k experts a row, their
 * weights renormalized if renorm, rounded to the element type unless float_weights. */
typedef struct {
    int32_t num_experts, top_k, renorm, float_weights;
    int64_t inter;
    Linear router;
    const Linear *gate_up, *down;
} Moe;

/* One decoder layer: norms of the element type ([hidden]; q_norm / k_norm [D] or NULL); moe: NULL for the
 * dense MLP (gate_up, down). */
typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm;
    Linear qkv, o, gate_up, down;
    const Moe *moe;
} Layer;

/* The kernels, resolved by the caller from their libraries. */
typedef struct {
    bf16_linear_fn gemv_bf16, gemm_bf16, gemm_amx;
    int4_linear_fn gemm_int4;
    rms_norm_fn rms_norm;
    rope_write_kv_fn rope_write_kv;
    attention_fn attention;
    silu_mul_fn silu_mul;
    argmax_fn argmax_rows;                   /* used by pd_decode_graph_steps only */
} Kernels;

/* The model: shapes, the element type (bf16 = 1, else float32), the layers, the final norm. */
typedef struct {
    int64_t hidden, H, Hkv, D, inter, num_layers;
    int32_t bf16, _pad;
    float eps, scale;
    const Layer *layers;
    const void *final_norm;
    Kernels k;
} Model;

/* The step: cos / sin float32 [n, D]; cache: the whole KV cache, layer l at cache + l * s_layer
 * bytes; strides in elements; slots int64 [n]; qs int32 [B + 1], seq_lens int32 [B],
 * tables int32 [B, max_blocks]. */
typedef struct {
    const float *cos_t, *sin_t;
    char *cache;
    int64_t s_layer_bytes, s_block, s_tok, s_head, s_v, block_size;
    const int64_t *slots;
    const int32_t *qs, *seq_lens, *tables;
    int64_t B, max_blocks;
} Step;


/* x[i] = x[i] + y[i], rounded to the element type (torch's add on bf16 or float32 tensors). */
static void add_inplace(void *x, const void *y, int64_t count, int bf16) {
    if (!bf16) {
        float *a = x; const float *b = y;
        for (int64_t i = 0; i < count; i++) a[i] += b[i];
        return;
    }
    uint16_t *a = x; const uint16_t *b = y;
    for (int64_t i = 0; i < count; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* y[r, :] += bias, y [rows, N] of the element type; computed in float32, rounded once. */
static void add_bias(void *y, const void *bias, int bias_bf16, int64_t rows, int64_t N, int bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < N; j++) {
            const float b = bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
            if (bf16) {
                uint16_t *row = (uint16_t *)y + r * N;
                row[j] = f32_to_bf16(bf16_to_f32(row[j]) + b);
            } else {
                ((float *)y + r * N)[j] += b;
            }
        }
}

/* y [n, N] = x [n, K] W^T (+ bias). Returns the kernel's status (0 = done). */
static int linear(const Model *m, const Linear *l, const void *x, void *y, int64_t n) {
    int rc;
    if (l->kind == LINEAR_INT4) {
        rc = m->k.gemm_int4(x, m->bf16, n, l->K, l->K, l->Kp, l->G, l->w, l->sc, l->zc, l->Np, l->N, y, m->bf16, l->N);
    } else {
        const bf16_linear_fn fn = n <= l->gemv_max_rows ? m->k.gemv_bf16 : l->amx ? m->k.gemm_amx : m->k.gemm_bf16;
        rc = fn(x, n, l->K, l->K, l->w, l->Np, l->N, y, l->N);
    }
    if (rc == 0 && l->bias) add_bias(y, l->bias, l->bias_bf16, n, l->N, m->bf16);
    return rc;
}

static void *carve(char **p, size_t bytes) {            /* 64-byte aligned slices of the scratch block */
    void *out = *p;
    *p += (bytes + 63) / 64 * 64;
    return out;
}

#include "moe_mlp.h"   /* pd_moe_route, moe_mlp, pd_moe_block */

/* Scratch of one step, element counts per row (float32 counts for q and attn). */
static size_t row_bytes(const Model *m) {
    const size_t e = m->bf16 ? 2 : 4, qkv = (size_t)((m->H + 2 * m->Hkv) * m->D), hd = (size_t)(m->H * m->D);
    const size_t h = (size_t)m->hidden, inter = (size_t)m->inter;
    return e * (h + qkv + hd + h + 2 * inter + inter) + 4 * (2 * hd) + 64 * 8;
}

/* Runs layers [0, num_layers) of `m` over x (element type [n, hidden], updated in place: the
 * residual stream) and writes the final RMSNorm of the result to out ([n, hidden]).
 * Returns 0; -1 if its scratch memory could not be allocated; otherwise 1000 * (layer + 1) plus
 * the failing kernel's negative code (-1: out of scratch memory, -2: AMX refused). */
int pd_decode_stack(const Model *m, const Step *s, void *x, void *out, int64_t n, int64_t num_layers) {
    const size_t e = m->bf16 ? 2 : 4, hidden = (size_t)m->hidden, hd = (size_t)(m->H * m->D);
    const int64_t qkv_n = (m->H + 2 * m->Hkv) * m->D;
    char *block = aligned_alloc(64, (row_bytes(m) * (size_t)n + 63) / 64 * 64), *p = block;
    if (!block) return -1;
    void *h = carve(&p, e * hidden * n), *qkv = carve(&p, e * (size_t)qkv_n * n);
    float *q = carve(&p, 4 * hd * n), *att = carve(&p, 4 * hd * n);
    void *att_e = m->bf16 ? carve(&p, e * hd * n) : att;
    void *proj = carve(&p, e * hidden * n), *gu = carve(&p, e * 2 * (size_t)m->inter * n);
    void *act = carve(&p, e * (size_t)m->inter * n);
    int rc = 0;
    int64_t li = 0;
    for (; li < num_layers; li++) {
        const Layer *L = &m->layers[li];
        char *cache = s->cache + li * s->s_layer_bytes;
        m->k.rms_norm(x, L->input_norm, h, n, m->hidden, m->hidden, m->hidden, m->eps, m->bf16);
        if ((rc = linear(m, &L->qkv, h, qkv, n))) break;
        m->k.rope_write_kv(qkv, n, qkv_n, m->H, m->Hkv, m->D, s->cos_t, s->sin_t, q, 0, cache, s->s_block, s->s_tok,
                           s->s_head, s->s_v, s->slots, s->block_size, m->bf16, L->q_norm, L->k_norm, m->eps);
        if ((rc = m->k.attention(q, att, m->H, m->Hkv, m->D, s->qs, s->seq_lens, s->B, cache, m->bf16, s->s_block,
                                 s->s_tok, s->s_head, s->s_v, s->tables, s->max_blocks, s->block_size, m->scale)))
            break;
        if (m->bf16)
            for (size_t i = 0; i < hd * (size_t)n; i++) ((uint16_t *)att_e)[i] = f32_to_bf16(att[i]);
        if ((rc = linear(m, &L->o, att_e, proj, n))) break;
        add_inplace(x, proj, (int64_t)hidden * n, m->bf16);
        m->k.rms_norm(x, L->post_norm, h, n, m->hidden, m->hidden, m->hidden, m->eps, m->bf16);
        if (L->moe) {
            if ((rc = moe_mlp(m, L->moe, h, proj, n))) break;
            add_inplace(x, proj, (int64_t)hidden * n, m->bf16);
            continue;
        }
        if ((rc = linear(m, &L->gate_up, h, gu, n))) break;
        m->k.silu_mul(gu, n, m->inter, 2 * m->inter, act, m->bf16);
        if ((rc = linear(m, &L->down, act, proj, n))) break;
        add_inplace(x, proj, (int64_t)hidden * n, m->bf16);
    }
    if (rc) rc += 1000 * (int)(li + 1);
    else m->k.rms_norm(x, m->final_norm, out, n, m->hidden, m->hidden, m->hidden, m->eps, m->bf16);
    free(block);
    return rc;
}

/* ---- a whole decode step over static buffers: the CPU counterpart of a captured CUDA graph ----
 *
 * The decode worker's graph runner keeps one set of input buffers (token ids, context lengths,
 * block tables); a step's metadata, embedding lookup, rotary tables, layers and LM head are all
 * derived from them here, so the Python side of a step is filling three buffers and one call:
 *
 *   pos = seq_lens[i] - 1;  slot[i] = tables[i, pos / block_size] * block_size + pos % block_size
 *   x[i] = embed[token_ids[i]];  cos/sin rows = cos_table / sin_table [pos]
 *   h = pd_decode_stack(x);  logits[i] = float32(linear(h[i], lm_head))
 *
 * The rotary tables are the model's own (model/rope.py computed for positions 0..positions-1), and
 * the LM head rounds to the element type before widening as torch's lm_head(h).float() does, so
 * the logits are bit-identical to the per-operation path's. */
typedef struct {
    const int64_t *token_ids;                /* [B] */
    const int32_t *seq_lens, *tables;        /* [B], [B, max_blocks] */
    int64_t max_blocks, block_size, num_blocks;
    const void *embed;                       /* [vocab, hidden], element type */
    int64_t vocab;
    const float *cos_table, *sin_table;      /* [positions, D] */
    int64_t positions;
    char *cache;
    int64_t s_layer_bytes, s_block, s_tok, s_head, s_v;
    Linear lm_head;                          /* N = the logits' width */
} Graph;

/* Checks every row's token, context length and block ids before anything is written: -3 if one is
 * out of range (token >= vocab, seq_len outside [1, positions], a block id outside the cache). */
static int graph_rows_valid(const Graph *g, int64_t B) {
    for (int64_t i = 0; i < B; i++) {
        const int64_t t = g->token_ids[i], len = g->seq_lens[i];
        if (t < 0 || t >= g->vocab || len < 1 || len > g->positions || (len - 1) / g->block_size >= g->max_blocks)
            return -3;
        for (int64_t b = 0; b <= (len - 1) / g->block_size; b++) {
            const int32_t blk = g->tables[i * g->max_blocks + b];
            if (blk < 0 || blk >= g->num_blocks) return -3;
        }
    }
    return 0;
}

/* Runs the whole step for rows [0, B) and writes float32 logits [B, lm_head.N]. Returns 0, -3 for
 * a row out of range (nothing written), -1 when scratch memory is short, or pd_decode_stack's code. */
/* pd_decode_graph without the range check (for callers that have checked every row already). */
static int graph_step(const Model *m, const Graph *g, int64_t B, float *logits) {
    const size_t e = m->bf16 ? 2 : 4, hidden = (size_t)m->hidden, D = (size_t)m->D, V = (size_t)g->lm_head.N;
    const size_t bytes = 2 * e * hidden * B + 2 * 4 * D * B + 8 * B + 4 * (B + 1) + e * V * B + 6 * 64;
    char *block = aligned_alloc(64, (bytes + 63) / 64 * 64), *p = block;
    if (!block) return -1;
    char *x = carve(&p, e * hidden * B), *h = carve(&p, e * hidden * B);
    float *cos_t = carve(&p, 4 * D * B), *sin_t = carve(&p, 4 * D * B);
    int64_t *slots = carve(&p, 8 * B);
    int32_t *qs = carve(&p, 4 * (B + 1));
    void *logits_e = m->bf16 ? carve(&p, e * V * B) : logits;
    for (int64_t i = 0; i < B; i++) {
        const int64_t pos = g->seq_lens[i] - 1;
        slots[i] = (int64_t)g->tables[i * g->max_blocks + pos / g->block_size] * g->block_size + pos % g->block_size;
        qs[i] = (int32_t)i;
        memcpy(x + e * hidden * i, (const char *)g->embed + e * hidden * g->token_ids[i], e * hidden);
        memcpy(cos_t + D * i, g->cos_table + D * pos, 4 * D);
        memcpy(sin_t + D * i, g->sin_table + D * pos, 4 * D);
    }
    qs[B] = (int32_t)B;
    const Step s = {cos_t, sin_t, g->cache, g->s_layer_bytes, g->s_block, g->s_tok, g->s_head, g->s_v,
                    g->block_size, slots, qs, g->seq_lens, g->tables, B, g->max_blocks};
    int rc = pd_decode_stack(m, &s, x, h, B, m->num_layers);
    if (!rc && !(rc = linear(m, &g->lm_head, h, logits_e, B)) && m->bf16)
        for (size_t i = 0; i < V * (size_t)B; i++) logits[i] = bf16_to_f32(((const uint16_t *)logits_e)[i]);
    free(block);
    return rc;
}

int pd_decode_graph(const Model *m, const Graph *g, int64_t B, float *logits) {
    return graph_rows_valid(g, B) ? -3 : graph_step(m, g, B, logits);
}

/* ---- several steps in one call: multi-step decoding ----
 *
 * A batch-1 step streams every weight once, which evicts the caches, so whatever runs between two
 * steps in Python (sampling, bookkeeping, the next call's arguments) runs from DRAM: about 0.4 ms
 * around a 5 ms bench-80m bf16 step on Zen 4, where the same code warm takes 0.1 ms. When every row
 * samples greedily or from softmax(logits / temperature), top-k cut or not, a step's inputs follow from the last
 * step's logits and noise drawn in advance, so up to `steps` steps run here back to back (vLLM's
 * multi-step scheduling, 2024):
 *
 *   logits = step(token_ids, seq_lens);  token_ids[i] = pick(logits[i]);  seq_lens[i] += 1
 *   pick: temps == NULL or temps[i] == 0: argmax (torch's index);
 *         else argmax_j (logits[i, j] / temps[i] - log_noise[s, i, j]) over the top_ks[i] largest (all
 *         when 0 or NULL), the exponential race in log space with the caller's noise
 *         (model/sampling.py: temperature_draw, the same float32 operations)
 *
 * on private copies of token_ids and seq_lens (the static buffers are not changed). After a step
 * the loop ends early when a row sampled one of `stops` (the union of the rows' stop tokens: the
 * caller decides which row really ends) or when *interrupt is non-zero (another thread has work for
 * the scheduler: a request arrived, KV pages landed, a client left), so nobody waits behind the
 * loop longer than one step. Every row must have `steps` positions left in its blocks: the whole
 * range is checked before anything is written.
 *
 * tokens: int64 [steps, B], row s = step s's tokens; logits: float32 scratch [B, lm_head.N] (the
 * last step's logits on return); temps: float32 [B] or NULL; top_ks: int32 [B] or NULL;
 * log_noise: float32 [steps, B, lm_head.N]
 * (read for rows with temps[i] > 0 only). *done = the steps run. Returns 0, -3 for a row whose token,
 * final context length or blocks are out of range or an LM head wider than the embedding (nothing
 * written), -1 when scratch memory is short, or pd_decode_stack's code (*done steps are complete). */

int pd_decode_graph_steps(const Model *m, const Graph *g, int64_t B, int64_t steps, const float *temps,
                          const int32_t *top_ks, const float *log_noise, const int64_t *stops, int64_t num_stops,
                          const volatile int32_t *interrupt, float *logits, int64_t *tokens, int64_t *done) {
    *done = 0;
    if (B < 1 || steps < 1 || g->lm_head.N > g->vocab || !m->k.argmax_rows) return -3;
    int64_t *ids = malloc(8 * (size_t)B);
    int32_t *lens = malloc(4 * (size_t)B);
    void *scratch = temps ? malloc(8 * (size_t)g->lm_head.N) : NULL;
    int rc = ids && lens && (scratch || !temps) ? 0 : -1;
    Graph run = *g;
    run.token_ids = ids, run.seq_lens = lens;
    for (int64_t i = 0; !rc && i < B; i++) {
        ids[i] = g->token_ids[i];
        lens[i] = g->seq_lens[i] < 1 || g->seq_lens[i] > g->positions ? 0 : (int32_t)(g->seq_lens[i] + steps - 1);
    }
    if (!rc && graph_rows_valid(&run, B)) rc = -3;      /* the last step's positions and blocks, every row */
    for (int64_t i = 0; !rc && i < B; i++) lens[i] = g->seq_lens[i];
    const int64_t N = g->lm_head.N;
    for (int64_t s = 0; !rc && s < steps; s++) {
        if ((rc = graph_step(m, &run, B, logits))) break;     /* every step's rows checked above */
        int64_t *out = tokens + s * B;
        m->k.argmax_rows(logits, B, N, N, out);
        for (int64_t i = 0; temps && i < B; i++)
            if (temps[i] > 0)
                out[i] = temperature_argmax(logits + i * N, log_noise + (s * B + i) * N, N, temps[i],
                                            top_ks ? top_ks[i] : 0, scratch);
        int stop = *interrupt != 0;
        for (int64_t i = 0; i < B; i++) {
            ids[i] = out[i], lens[i] += 1;
            for (int64_t j = 0; j < num_stops; j++) stop |= out[i] == stops[j];
        }
        *done = s + 1;
        if (stop) break;
    }
    free(ids);
    free(lens);
    free(scratch);
    return rc;
}

/* One row of temperature_argmax, for tests against model/sampling.py: temperature_draw (x, g: [n]
 * float32; t > 0; top_k 0 for no cut). Returns the token, or -1 when scratch memory is short. */
int64_t pd_temperature_argmax(const float *x, const float *g, int64_t n, float t, int64_t top_k) {
    void *scratch = malloc(8 * (size_t)n);
    if (!scratch) return -1;
    const int64_t token = temperature_argmax(x, g, n, t, top_k, scratch);
    free(scratch);
    return token;
}
