/* Mixtures of experts in the decode stack: the routing (softmax, top-k, renormalization) and a mixture's MLP
 * over the rows routed to each expert, with the stack's kernels. Included by decode_stack.c only, after its
 * types (Model, Moe, Linear), linear() and carve(); the library exports pd_moe_route and pd_moe_block from here.
 */
#ifndef PD_MOE_MLP_H
#define PD_MOE_MLP_H

/* The routing of n rows from their router logits ([n, E], bf16 if bf16 else float32): per row, softmax in
 * float32 (expf), the top_k experts by probability (ties: the lower index first) into idx [n, top_k], their
 * probabilities into w [n, top_k] (divided by their sum if renorm; rounded to bf16 if round_bf16). torch's
 * softmax / topk compute the same up to an ulp of the softmax; model/moe.py routes decode steps here too,
 * so the stack and the per-operation path pick the same experts with the same weights. Returns 0, -1 for
 * top_k outside [1, min(E, 64)], -2 when its scratch memory is short. */
int pd_moe_route(const void *logits, int64_t n, int64_t E, int64_t top_k, int renorm, int round_bf16, int bf16,
                 int32_t *idx, float *w) {
    if (top_k < 1 || top_k > E || top_k > 64) return -1;
    float *prob = malloc(4 * (size_t)E);           /* one row's softmax; a chosen expert's set to -1 */
    if (!prob) return -2;
    for (int64_t r = 0; r < n; r++) {
        float mx = -INFINITY, sum = 0.f, p[64];
        int32_t *ir = idx + r * top_k;
        float *wr = w + r * top_k;
        for (int64_t j = 0; j < E; j++) {
            prob[j] = bf16 ? bf16_to_f32(((const uint16_t *)logits)[r * E + j]) : ((const float *)logits)[r * E + j];
            mx = prob[j] > mx ? prob[j] : mx;
        }
        for (int64_t j = 0; j < E; j++) sum += expf(prob[j] - mx);
        for (int64_t j = 0; j < E; j++) prob[j] = expf(prob[j] - mx) / sum;
        for (int64_t t = 0; t < top_k; t++) {         /* top_k passes: k is small */
            int32_t best = -1;
            float bv = -1.f;
            for (int64_t j = 0; j < E; j++)
                if (prob[j] > bv) bv = prob[j], best = (int32_t)j;
            ir[t] = best, p[t] = bv;
            if (best >= 0) prob[best] = -1.f;
        }
        float s = 0.f;
        for (int64_t t = 0; t < top_k; t++) s += p[t];
        for (int64_t t = 0; t < top_k; t++) {
            const float v = renorm ? p[t] / s : p[t];
            wr[t] = round_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
        }
    }
    free(prob);
    return 0;
}

/* out [n, hidden] = the mixture's output for h [n, hidden] (element type): the experts in ascending order,
 * each over the rows routed to it, out[r] += (expert(h[r]) * w) rounded to the element type, from zero, as
 * model/moe.py's index_add_ adds them. Returns 0, -1 when scratch memory is short, or a kernel's code. */
static int moe_mlp(const Model *m, const Moe *me, const void *h, void *out, int64_t n) {
    const size_t e = m->bf16 ? 2 : 4, hidden = (size_t)m->hidden, I = (size_t)me->inter, E = (size_t)me->num_experts;
    const int64_t k = me->top_k;
    const size_t bytes = e * E * n + (4 + 4 + 8) * (size_t)(k * n) + e * (hidden + 3 * I + hidden) * n + 8 * 64;
    char *block = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!block) return -1;
    char *p = block;
    void *rl = carve(&p, e * E * n);
    int32_t *idx = carve(&p, 4 * (size_t)(k * n));
    float *w = carve(&p, 4 * (size_t)(k * n));
    int64_t *rows = carve(&p, 8 * (size_t)(k * n));
    void *xs = carve(&p, e * hidden * n), *gu = carve(&p, e * 2 * I * n), *act = carve(&p, e * I * n);
    void *y = carve(&p, e * hidden * n);
    int rc = linear(m, &me->router, h, rl, n);
    if (!rc && pd_moe_route(rl, n, (int64_t)E, k, me->renorm, m->bf16 && !me->float_weights, m->bf16, idx, w))
        rc = -1;                                     /* top_k was checked when the stack was built: memory */
    memset(out, 0, e * hidden * n);
    for (int64_t ex = 0; !rc && ex < (int64_t)E; ex++) {
        int64_t cnt = 0;
        for (int64_t i = 0; i < k * n; i++)
            if (idx[i] == ex) rows[cnt++] = i;               /* row i / k, its weight w[i] */
        if (!cnt) continue;
        for (int64_t c = 0; c < cnt; c++) memcpy((char *)xs + e * hidden * c, (const char *)h + e * hidden * (rows[c] / k),
                                                 e * hidden);
        if ((rc = linear(m, &me->gate_up[ex], xs, gu, cnt))) break;
        m->k.silu_mul(gu, cnt, (int64_t)I, 2 * (int64_t)I, act, m->bf16);
        if ((rc = linear(m, &me->down[ex], act, y, cnt))) break;
        for (int64_t c = 0; c < cnt; c++) {
            const float wt = w[rows[c]];
            const int64_t r = rows[c] / k;
            for (size_t j = 0; j < hidden; j++) {
                if (m->bf16) {
                    uint16_t *o = (uint16_t *)out + hidden * r + j;
                    const float t = bf16_to_f32(f32_to_bf16(bf16_to_f32(((const uint16_t *)y)[hidden * c + j]) * wt));
                    *o = f32_to_bf16(bf16_to_f32(*o) + t);
                } else {
                    ((float *)out)[hidden * r + j] += ((const float *)y)[hidden * c + j] * wt;
                }
            }
        }
    }
    free(block);
    return rc;
}

/* One mixture over n rows of h outside a decode step (a prefill chunk's MLP, model/moe.py's SparseMoeBlock):
 * moe_mlp with the model's kernels; out [n, hidden] of the element type. Returns as moe_mlp. */
int pd_moe_block(const Model *m, const Moe *me, const void *h, void *out, int64_t n) {
    return moe_mlp(m, me, h, out, n);
}

#endif
