/* The paged cache as paged_attention.c walks it (Ctx) and its portable path: an exact two-pass
 * softmax per sequence as PagedAttention v1 (Kwon et al., SOSP 2023), for head sizes and CPUs the
 * AVX-512 path does not take. Included by paged_attention.c only. */
#ifndef PD_PAGED_ATTENTION_PORTABLE_H
#define PD_PAGED_ATTENTION_PORTABLE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#pragma omp declare simd notinbranch
extern float expf(float);                                /* glibc's vector variants (libmvec) */

typedef struct {
    const void *cache; int bf16; int64_t s_block, s_tok, s_head, s_v, block_size, D;
    const int32_t *table;
    int head_major;                                      /* the AVX-512 path's walk (paged_attention.c) */
} Ctx;

static inline int64_t kv_offset(const Ctx *c, int64_t t, int64_t kvh) {
    return (int64_t)c->table[t / c->block_size] * c->s_block + (t % c->block_size) * c->s_tok + kvh * c->s_head;
}


static void load_row(const Ctx *c, int64_t off, float *dst) {
    if (c->bf16) {
        const uint16_t *p = (const uint16_t *)c->cache + off;
        for (int64_t d = 0; d < c->D; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)c->cache + off, (size_t)c->D * sizeof(float));
    }
}

/* Pairs p0 .. p0 + R of kv head kvh (pair p: query row p / G of the sequence, head kvh G + p % G), for a
 * sequence whose query rows start at q0 and whose first new token sits at position `first`: their query
 * and output rows and causal limits. */
static inline void group_pairs(int64_t p0, int R, int64_t G, int64_t H, int64_t D, int64_t kvh, int64_t q0,
                               int64_t first, const float *q, float *out, const float **qrow, float **orow,
                               int64_t *lim) {
    for (int r = 0; r < R; r++) {
        const int64_t i = (p0 + r) / G, h = kvh * G + (p0 + r) % G;
        qrow[r] = q + ((q0 + i) * H + h) * D;
        orow[r] = out + ((q0 + i) * H + h) * D;
        lim[r] = first + i;
    }
}

/* p = softmax(s[0..n)) in place, n >= 1 */
static void softmax(float *s, int64_t n) {
    float mx = s[0], sum = 0.f;
    for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* Portable: rows qrow[r] (float32, D) with limits lim[r] -> orow[r]; scores has R x L floats. */
static void rows_portable(const Ctx *c, int64_t kvh, int R, const float **qrow, float **orow,
                          const int64_t *lim, int64_t L, float scale, float *scores, float *buf) {
    const int64_t D = c->D;
    for (int64_t t = 0; t < L; t++) {
        load_row(c, kv_offset(c, t, kvh), buf);
        for (int r = 0; r < R; r++) {
            if (t > lim[r]) continue;
            float s = 0.f;
#pragma omp simd reduction(+ : s)              /* lanes summed apart, then together: vectorized */
            for (int64_t d = 0; d < D; d++) s += qrow[r][d] * buf[d];
            scores[r * L + t] = scale * s;
        }
    }
    for (int r = 0; r < R; r++) { softmax(scores + r * L, lim[r] + 1); memset(orow[r], 0, D * sizeof(float)); }
    for (int64_t t = 0; t < L; t++) {
        load_row(c, kv_offset(c, t, kvh) + c->s_v, buf);
        for (int r = 0; r < R; r++) {
            if (t > lim[r]) continue;
            const float p = scores[r * L + t];
            for (int64_t d = 0; d < D; d++) orow[r][d] += p * buf[d];
        }
    }
}

#endif
