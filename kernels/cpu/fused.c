/* The small per-layer operations of a decode step, fused so that a layer costs a handful
 * of calls instead of dozens of tensor operations (each ~5 us of framework overhead at
 * decode sizes, more than their arithmetic).
 *
 *   pd_rms_norm       out = w * rmsnorm(x)                                      (RMSNorm, Zhang & Sennrich 2019)
 *   pd_add_rms_norm   sum = x + r; out = w * rmsnorm(sum)                       (a residual add and the next norm,
 *                                                                                as vLLM's fused_add_rms_norm)
 *   pd_rope_write_kv  q_out = rope(q); cache[slot] = (rope(k), v)               (RoPE, Su et al. 2021)
 *                     (q_out float32 for the decode attention, or the element type for the prefill one)
 *                     optionally q, k = rmsnorm per head first (Qwen3's q_norm / k_norm)
 *   pd_silu_mul(_to)  out = silu(gate) * up (_to: into rows of a given stride)   (SwiGLU, Shazeer 2020)
 *   pd_argmax_rows    out[i] = argmax_j x[i, j], as torch.argmax picks       (greedy sampling)
 *   pd_mask_logits    x[j] = -inf where a grammar's token bitmask clears bit j     (structured output)
 *
 * On AVX-512 (PD_VECTOR_NORM) every one runs on 16 lanes and serves prefill-sized steps too.
 *
 * Element type: float32 or bfloat16 (flag bf16). Every result is rounded to the element
 * type where the torch code it replaces (model/llama.py, model/rope.py) rounds, and nothing is contracted
 * into an FMA (built with -ffp-contract=off), so float32 results match it up to the order
 * of the RMS sum.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#pragma omp declare simd notinbranch
extern float expf(float);                                /* glibc's vector variants (libmvec) */

static inline float get(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v); else ((float *)p)[i] = v;
}

static inline float rnd(float v, int bf16) {           /* v as the element type holds it */
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)   /* -march=native on AVX-512 */
#define PD_VECTOR_NORM 1
#include <immintrin.h>

#include "exp16.h"

static inline __m512 load16(const void *p, int64_t i, int bf16, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 lanes rounded to bf16 (nearest even, NaN quiet): one vcvtneps2bf16 where AVX512-BF16 is
 * there, the same result as bf16.h's integer sequence (eight instructions) elsewhere. */
static inline __m256i bf16x16(__m512 f) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    return _mm512_cvtepi32_epi16(f32_to_bf16_x16(f));
#endif
}

static inline __m512 rnd16(__m512 f, int bf16) {         /* f as the element type holds it */
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(f)), 16)) : f;
}

/* rnd16 of a and of b, in place: with AVX512-BF16 one conversion of both to 32 bf16 (vcvtne2ps2bf16) and a masked
 * word permute each back into the high halves of the lanes, four instructions where two rnd16 take eight.
 * Returns that conversion (a's words first) for store16_pair, else zero. */
static inline __m512i rnd2x16(__m512 *a, __m512 *b, int bf16) {
#ifdef __AVX512BF16__
    if (bf16) {
        static const uint16_t lo[32] __attribute__((aligned(64))) = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8,
                                                                   9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(*b, *a), ia = _mm512_load_si512(lo);   /* a: words 0-15 */
        *a = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, ia, both));
        *b = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, _mm512_add_epi16(ia, _mm512_set1_epi16(16)),
                                                                both));
        return both;
    }
#endif
    *a = rnd16(*a, bf16);
    *b = rnd16(*b, bf16);
    return _mm512_setzero_si512();
}

static inline void store16(void *p, int64_t i, __m512 f, int bf16, __mmask16 m) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, bf16x16(f));
    else _mm512_mask_storeu_ps((float *)p + i, m, f);
}

/* store16 of a at i and b at i + 16, whole: with AVX512-BF16 one conversion of both and one 64-byte store. */
static inline void store2x16(void *p, int64_t i, __m512 a, __m512 b, int bf16) {
#ifdef __AVX512BF16__
    if (bf16) {
        _mm512_storeu_si512((uint16_t *)p + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        return;
    }
#endif
    store16(p, i, a, bf16, 0xffff);
    store16(p, i + 16, b, bf16, 0xffff);
}

/* store16 of a at i and b at j, whole, for a and b that rnd2x16 rounded to bf16: with AVX512-BF16 its conversion
 * `both` stored as it is (two 32-byte stores). */
static inline void store16_pair(void *p, int64_t i, int64_t j, __m512 a, __m512 b, __m512i both, int bf16) {
#ifdef __AVX512BF16__
    if (bf16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_castsi512_si256(both));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + j), _mm512_extracti64x4_epi64(both, 1));
        return;
    }
#endif
    store16(p, i, a, bf16, 0xffff);
    store16(p, j, b, bf16, 0xffff);
}
#endif

/* 1 where these kernels run on AVX-512 (then faster than torch's operators at any row count). */
int pd_vectorized(void) {
#ifdef PD_VECTOR_NORM
    return 1;
#else
    return 0;
#endif
}

/* x, out: [n, dim] with row strides ldx, ldo; w: [dim]. The sum of squares runs in 16 float32
 * lanes on AVX-512 (one lane per column modulo 16, folded at the end), else in column order. */
#ifdef PD_VECTOR_NORM
static inline __mmask16 tail16(int64_t dim, int64_t d) {   /* the lanes of columns d.. that exist */
    return dim - d >= 16 ? 0xffff : (__mmask16)((1u << (dim - d)) - 1);
}

/* Columns d..d+16 (lanes m) of normed_row16: w * (src * inv), rounded as the torch code rounds. */
static inline __attribute__((always_inline)) void normed16(const void *src, int64_t so, const void *w, void *out,
                                                           int64_t oo, int64_t d, __m512 inv, __mmask16 m, int in_bf16,
                                                           int bf16) {
    const __m512 normed = rnd16(_mm512_mul_ps(load16(src, so + d, in_bf16, m), inv), bf16);
    store16(out, oo + d, _mm512_mul_ps(load16(w, d, in_bf16, m), normed), bf16, m);
}

/* out[0..dim) = w * (src * inv) from a row's 16-lane sum of squares acc, rounded as the torch code rounds.
 * src and w hold bf16 where in_bf16 is set, else float32 (the same values widened); out and the rounding: bf16.
 * Whole vectors unmasked, the row's tail masked (a mask made at every vector cost seven scalar instructions and a
 * mask move each: bench-80m's add + RMSNorm rows on the AMX Xeon 167, bench/kernel_ab.py). */
static inline __attribute__((always_inline)) void normed_row16(const void *src, int64_t so, const void *w, void *out,
                                int64_t oo, int64_t dim, __m512 acc, float eps, int in_bf16, int bf16) {
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {              /* two vectors: their roundings and stores paired */
        __m512 a = _mm512_mul_ps(load16(src, so + d, in_bf16, 0xffff), inv);
        __m512 b = _mm512_mul_ps(load16(src, so + d + 16, in_bf16, 0xffff), inv);
        rnd2x16(&a, &b, bf16);
        store2x16(out, oo + d, _mm512_mul_ps(load16(w, d, in_bf16, 0xffff), a),
                  _mm512_mul_ps(load16(w, d + 16, in_bf16, 0xffff), b), bf16);
    }
    for (; d + 16 <= dim; d += 16) normed16(src, so, w, out, oo, d, inv, 0xffff, in_bf16, bf16);
    if (d < dim) normed16(src, so, w, out, oo, d, inv, tail16(dim, d), in_bf16, bf16);
}

static inline __m512 squares16(__m512 acc, __m512 v) { return _mm512_add_ps(acc, _mm512_mul_ps(v, v)); }

/* Columns d..d+16 (lanes m; the others zero) of add_row16; returns acc plus their squares. */
static inline __attribute__((always_inline)) __m512 add16(const void *x, int64_t xo, const void *r, int64_t ro,
                                                          void *sum, int64_t so, float *keep, int64_t d, __mmask16 m,
                                                          __m512 acc, int bf16) {
    const __m512 v = rnd16(_mm512_add_ps(load16(x, xo + d, bf16, m), load16(r, ro + d, bf16, m)), bf16);
    store16(sum, so + d, v, bf16, m);
    if (keep) _mm512_store_ps(keep + d, v);
    return squares16(acc, v);
}

/* sum[so..so+dim) = x + r rounded to the element type (torch's add), also kept in keep[0..dim) as float32
 * where keep is not NULL; returns the row's 16-lane sum of squares. */
static inline __attribute__((always_inline)) __m512 add_row16(const void *x, int64_t xo, const void *r, int64_t ro,
                                                              void *sum, int64_t so, float *keep, int64_t dim, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {              /* two vectors: their roundings and stores paired; squares in order */
        __m512 a = _mm512_add_ps(load16(x, xo + d, bf16, 0xffff), load16(r, ro + d, bf16, 0xffff));
        __m512 b = _mm512_add_ps(load16(x, xo + d + 16, bf16, 0xffff), load16(r, ro + d + 16, bf16, 0xffff));
        const __m512i both = rnd2x16(&a, &b, bf16);
        store16_pair(sum, so + d, so + d + 16, a, b, both, bf16);
        if (keep) { _mm512_store_ps(keep + d, a); _mm512_store_ps(keep + d + 16, b); }
        acc = squares16(squares16(acc, a), b);
    }
    for (; d + 16 <= dim; d += 16) acc = add16(x, xo, r, ro, sum, so, keep, d, 0xffff, acc, bf16);
    if (d < dim) acc = add16(x, xo, r, ro, sum, so, keep, d, tail16(dim, d), acc, bf16);
    return acc;
}
#endif

void pd_rms_norm(const void *x, const void *w, void *out, int64_t n, int64_t dim, int64_t ldx, int64_t ldo,
                 float eps, int bf16) {
#ifdef PD_VECTOR_NORM
    for (int64_t i = 0; i < n; i++) {
        __m512 acc = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) acc = squares16(acc, load16(x, i * ldx + d, bf16, 0xffff));
        if (d < dim) acc = squares16(acc, load16(x, i * ldx + d, bf16, tail16(dim, d)));
        normed_row16(x, i * ldx, w, out, i * ldo, dim, acc, eps, bf16, bf16);
    }
#else
    for (int64_t i = 0; i < n; i++) {
        float ss = 0.f;
        for (int64_t d = 0; d < dim; d++) { const float v = get(x, i * ldx + d, bf16); ss += v * v; }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) {
            const float normed = rnd(get(x, i * ldx + d, bf16) * inv, bf16);
            put(out, i * ldo + d, get(w, d, bf16) * normed, bf16);
        }
    }
#endif
}

#define NORM_KEEP 8192                /* widths up to which pd_add_rms_norm keeps a row in float32 (32 KiB) */

/* sum = x + r rounded to the element type (torch's add), then out = w * rmsnorm(sum) exactly as pd_rms_norm
 * computes it from sum: one pass fewer over the rows than the two operations. x, r, sum, out: [n, dim]
 * with row strides ldx, ldr, lds, ldo. */
void pd_add_rms_norm(const void *x, const void *r, const void *w, void *sum, void *out, int64_t n, int64_t dim,
                     int64_t ldx, int64_t ldr, int64_t lds, int64_t ldo, float eps, int bf16) {
#ifdef PD_VECTOR_NORM
    if (dim <= NORM_KEEP) {             /* the row's sums and w kept in float32 between the passes */
        float v32[NORM_KEEP] __attribute__((aligned(64))), w32[NORM_KEEP] __attribute__((aligned(64)));
        for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(w32 + d, load16(w, d, bf16, tail16(dim, d)));
        for (int64_t i = 0; i < n; i++)
            normed_row16(v32, 0, w32, out, i * ldo, dim, add_row16(x, i * ldx, r, i * ldr, sum, i * lds, v32, dim, bf16),
                         eps, 0, bf16);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        normed_row16(sum, i * lds, w, out, i * ldo, dim, add_row16(x, i * ldx, r, i * ldr, sum, i * lds, NULL, dim, bf16),
                     eps, bf16, bf16);
#else
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < dim; d++)
            put(sum, i * lds + d, get(x, i * ldx + d, bf16) + get(r, i * ldr + d, bf16), bf16);
    pd_rms_norm(sum, w, out, n, dim, lds, ldo, eps, bf16);
#endif
}

/* x[0..D) = w * rmsnorm(x), rounded as pd_rms_norm rounds (the element type's RMSNorm of one head). */
static inline void head_rms_norm(float *x, const void *w, int64_t D, float eps, int bf16) {
    float ss = 0.f;
    for (int64_t d = 0; d < D; d++) ss += x[d] * x[d];
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int64_t d = 0; d < D; d++) x[d] = rnd(get(w, d, bf16) * rnd(x[d] * inv, bf16), bf16);
}

#ifdef PD_VECTOR_NORM
/* One head's D elements (D % 16 == 0) from src into x as float32, RMS-normalized with the q/k norm weight w
 * exactly as pd_rms_norm normalizes a row (the same 16-lane sum, roundings and products). */
static inline void head_norm16(const void *qkv, int64_t src, int64_t D, const void *w, float eps, int bf16, float *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = load16(qkv, src + d, bf16, 0xffff);
        acc = squares16(acc, v);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 normed = rnd16(_mm512_mul_ps(load16(qkv, src + d, bf16, 0xffff), inv), bf16);
        _mm512_storeu_ps(x + d, rnd16(_mm512_mul_ps(load16(w, d, bf16, 0xffff), normed), bf16));
    }
}

/* pd_rope_write_kv for D % 32 == 0, 16 lanes at a time, each row's cos and sin rounded once for all its
 * heads: the same operations and roundings as the scalar loop below (bit-identical without q/k norms; with
 * them the heads' sums of squares are taken 16 lanes at a time, as pd_rms_norm takes a row's, where the
 * scalar loop sums in order). bench-80m's layer at batch 32, Zen 4, a C harness: 29-30 -> 14 us. With the
 * norms (Qwen3) the AVX-512 path replaced the scalar loop for decode rows and the torch norm + RoPE + cache
 * write for prefill rows: a 512-token prefill of bench-80m-qwen3 spent 13.6 ms of 0.45 s in the latter. */
static void rope_write_kv_avx512(const void *qkv, int64_t n, int64_t ld, int64_t H, int64_t Hkv, int64_t D,
                                 const float *cos_t, const float *sin_t, void *q_out, int q_elem, void *cache,
                                 int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v,
                                 const int64_t *slots, int64_t block_size, int bf16,
                                 const void *q_norm_w, const void *k_norm_w, float eps) {
    const int64_t half = D / 2, esz = bf16 ? 2 : 4;
    const __m512 sign = _mm512_set1_ps(-0.f);
    float c[512], s[512], x[512];       /* the row's cos and sin as the element type holds them; a normed head */
    for (int64_t i = 0; i < n; i++) {
        for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(c + d, rnd16(_mm512_loadu_ps(cos_t + i * D + d), bf16));
            _mm512_storeu_ps(s + d, rnd16(_mm512_loadu_ps(sin_t + i * D + d), bf16));
        }
        const int64_t row = i * ld;
        const int64_t base = (slots[i] / block_size) * s_block + (slots[i] % block_size) * s_tok;
        for (int64_t h = 0; h < H + Hkv; h++) {                /* query heads, then key heads */
            const int64_t src = row + h * D;
            const void *norm_w = h < H ? q_norm_w : k_norm_w;
            if (norm_w) head_norm16(qkv, src, D, norm_w, eps, bf16, x);
            for (int64_t d = 0; d < half; d += 16) {           /* rotate_half: (-x2, x1) */
                const __m512 x1 = norm_w ? _mm512_loadu_ps(x + d) : load16(qkv, src + d, bf16, 0xffff);
                const __m512 x2 = norm_w ? _mm512_loadu_ps(x + half + d) : load16(qkv, src + half + d, bf16, 0xffff);
                const __m512 c1 = _mm512_loadu_ps(c + d), s1 = _mm512_loadu_ps(s + d);
                const __m512 c2 = _mm512_loadu_ps(c + half + d), s2 = _mm512_loadu_ps(s + half + d);
                __m512 a1 = _mm512_mul_ps(x1, c1), b1 = _mm512_mul_ps(_mm512_xor_ps(x2, sign), s1);
                __m512 a2 = _mm512_mul_ps(x2, c2), b2 = _mm512_mul_ps(x1, s2);
                rnd2x16(&a1, &b1, bf16);
                rnd2x16(&a2, &b2, bf16);
                __m512 lo = _mm512_add_ps(a1, b1), hi = _mm512_add_ps(a2, b2);
                const __m512i both = rnd2x16(&lo, &hi, bf16);
                if (h < H)                                     /* lo, hi are already rounded: exact in either type */
                    store16_pair(q_out, (i * H + h) * D + d, (i * H + h) * D + half + d, lo, hi, both,
                                 q_elem && bf16);
                else
                    store16_pair(cache, base + (h - H) * s_head + d, base + (h - H) * s_head + half + d, lo, hi, both,
                                 bf16);
            }
        }
        for (int64_t h = 0; h < Hkv; h++)                      /* V as it is */
            memcpy((char *)cache + (base + h * s_head + s_v) * esz, (const char *)qkv + (row + (H + Hkv + h) * D) * esz,
                   (size_t)(D * esz));
    }
}
#endif

/* qkv: [n, (H + 2 Hkv) D] rows of stride ld; cos, sin: float32 [n, D]; q_out: [n, H, D], float32, or the
 * element type where q_elem (the rotated queries are rounded to it either way: the value is the same).
 * cache: base of one layer; K of (block, off, head) at block*s_block + off*s_tok + head*s_head, V at + s_v.
 * slots: int64 [n] = block * block_size + offset.
 * q_norm_w, k_norm_w: [D] of the element type, or NULL: RMSNorm (eps) of each query / key head before RoPE. */
void pd_rope_write_kv(const void *qkv, int64_t n, int64_t ld, int64_t H, int64_t Hkv, int64_t D,
                      const float *cos_t, const float *sin_t, void *q_out, int q_elem, void *cache, int64_t s_block,
                      int64_t s_tok, int64_t s_head, int64_t s_v, const int64_t *slots, int64_t block_size,
                      int bf16, const void *q_norm_w, const void *k_norm_w, float eps) {
    const int64_t half = D / 2;
#ifdef PD_VECTOR_NORM
    if (half % 16 == 0) {
        rope_write_kv_avx512(qkv, n, ld, H, Hkv, D, cos_t, sin_t, q_out, q_elem, cache, s_block, s_tok, s_head, s_v,
                             slots, block_size, bf16, q_norm_w, k_norm_w, eps);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_t + i * D, *s = sin_t + i * D;
        const int64_t row = i * ld;
        const int64_t base = (slots[i] / block_size) * s_block + (slots[i] % block_size) * s_tok;
        for (int64_t h = 0; h < H + Hkv; h++) {                /* query heads, then key heads */
            const int64_t src = row + h * D;
            float x[512], v[512];                                /* D <= 512 (checked by the caller) */
            for (int64_t d = 0; d < D; d++) x[d] = get(qkv, src + d, bf16);
            const void *norm_w = h < H ? q_norm_w : k_norm_w;
            if (norm_w) head_rms_norm(x, norm_w, D, eps, bf16);
            for (int64_t d = 0; d < half; d++)                  /* rotate_half: (-x2, x1) */
                v[d] = rnd(rnd(x[d] * rnd(c[d], bf16), bf16) + rnd(-x[d + half] * rnd(s[d], bf16), bf16), bf16);
            for (int64_t d = half; d < D; d++)
                v[d] = rnd(rnd(x[d] * rnd(c[d], bf16), bf16) + rnd(x[d - half] * rnd(s[d], bf16), bf16), bf16);
            if (h < H && q_elem) for (int64_t d = 0; d < D; d++) put(q_out, (i * H + h) * D + d, v[d], bf16);
            else if (h < H) memcpy((float *)q_out + (i * H + h) * D, v, (size_t)D * sizeof(float));
            else for (int64_t d = 0; d < D; d++) put(cache, base + (h - H) * s_head + d, v[d], bf16);
        }
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t d = 0; d < D; d++)
                put(cache, base + h * s_head + s_v + d, get(qkv, row + (H + Hkv + h) * D + d, bf16), bf16);
    }
}

/* gate_up: [n, 2 inter] rows of stride ld (gate first); out: [n, inter] rows of stride ldo; silu_mul.h has
 * the arithmetic and, for bf16, the lookup of every gate's silu. */
#include "silu_mul.h"

/* pd_silu_mul_to with out contiguous ([n, inter]): the decode stack's and a mixture's call. */
void pd_silu_mul(const void *gate_up, int64_t n, int64_t inter, int64_t ld, void *out, int bf16) {
    pd_silu_mul_to(gate_up, n, inter, ld, out, inter, bf16);
}

/* x: float32 [n, vocab] rows of stride ld; out: int64 [n]. The index torch.argmax gives: the first
 * NaN of a row if it has one, else the first maximum (0 for a row of -inf). torch's CPU argmax runs
 * about 3 cycles an element, a tenth of a millisecond a step at batch 32 over bench-80m's 2,048-entry
 * vocabulary and milliseconds over a 128K one; this is two vector passes over a row in cache. */
void pd_argmax_rows(const float *x, int64_t n, int64_t vocab, int64_t ld, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ld;
        int64_t best = -1;
#ifdef PD_VECTOR_NORM
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        int64_t d = 0;
        for (; d + 16 <= vocab && !nan; d += 16) {
            const __m512 v = _mm512_loadu_ps(r + d);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        float m = _mm512_reduce_max_ps(mx);
        if (nan) {
            best = d - 16 + __builtin_ctz(nan);
        } else {
            for (; d < vocab; d++) {                       /* the tail, scalar */
                if (r[d] != r[d]) { best = d; break; }
                if (r[d] > m) m = r[d];
            }
            if (best < 0) {
                const __m512 vm = _mm512_set1_ps(m);
                for (d = 0; d + 16 <= vocab; d += 16) {
                    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + d), vm, _CMP_EQ_OQ);
                    if (eq) { best = d + __builtin_ctz(eq); break; }
                }
                for (; best < 0 && d < vocab; d++)
                    if (r[d] == m) best = d;
            }
        }
#else
        float m = -INFINITY;
        for (int64_t d = 0; d < vocab; d++) {
            if (r[d] != r[d]) { best = d; break; }
            if (best < 0 || r[d] > m) { m = r[d]; best = d; }
        }
#endif
        out[i] = best < 0 ? 0 : best;
    }
}

/* x[j] = -inf for every j < vocab whose bit j of `bits` (int32 words, bit j % 32 of word j / 32: xgrammar's
 * token bitmask) is clear: the tokens a grammar does not allow (model/structured.py). 16 tokens a mask. */
void pd_mask_logits(float *x, const uint32_t *bits, int64_t vocab) {
    int64_t j = 0;
#ifdef PD_VECTOR_NORM
    const uint16_t *halves = (const uint16_t *)bits;      /* little-endian: tokens 32w .. 32w + 15 first */
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= vocab; j += 16) {
        const __mmask16 keep = halves[j / 16];
        if (keep != 0xFFFF) _mm512_storeu_ps(x + j, _mm512_mask_mov_ps(ninf, keep, _mm512_loadu_ps(x + j)));
    }
#endif
    for (; j < vocab; j++)
        if (!(bits[j / 32] >> (j % 32) & 1u)) x[j] = -INFINITY;
}
