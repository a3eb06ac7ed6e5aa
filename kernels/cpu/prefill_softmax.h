/* The online-softmax step of one query row over one 32-key tile, shared by the AVX-512 prefill attention
 * kernels (prefill_attention.c, prefill_attention_amx.c; FlashAttention's, Dao et al., 2022): scale the
 * raw scores, mask keys past the row's n visible ones (n >= 1), move the reference max only when a score
 * passes it by SLACK (then alpha = exp(m - m'), else 1), and return P = exp(S - m) for keys 0-15 and 16-31.
 *
 * The walk runs in base 2, as FlashAttention-2's kernels do: the caller passes scale * log2(e), the row's
 * reference max m is kept in those units, and P = 2^(S' - m) (pow2_16). The including file defines NK (32)
 * and SLACK (natural units). Since 2026-11-28 (exp16 before): one layer's attention on AMX tiles 0.92x /
 * 0.86x at 512 / 2,048 tokens, the AVX512-BF16 and FMA builds 0.96-1.01x (bench/kernel_ab.py, Xeon 167). */
#ifndef PD_PREFILL_SOFTMAX_H
#define PD_PREFILL_SOFTMAX_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LOG2E 1.44269504088896341f

/* 2^x on 16 lanes for x <= ~64: n = round(x), 2^(x - n) by a degree-5 polynomial (relative error 1.9e-7 over
 * [-1/2, 1/2] in float32; least-squares fit of the relative error with p(0) = 1, made for this kernel),
 * times 2^n by vscalefps (exact); exactly 0 below x = -125, for -inf and NaN, and where `keep` is clear,
 * so that no lane makes a subnormal (see exp16.h: a microcode assist on Intel cores). 12 instructions
 * against exp16's 17 with the scaling and the max subtraction it needed in front: the softmax's vector
 * work is what bounds the AMX build (P is rounded to bf16, 2^-9, for the value sums anyway). */
__attribute__((target("avx512f"), always_inline)) static inline __m512 pow2_16(__m512 x, __mmask16 keep) {
    keep &= _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(x, 0x08);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3264693457e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6715157143e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507338622e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242023e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314697751e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* Keys of key tile t that a query row at position pos may see; where none (<= 0), the row is unchanged:
 * its alpha is 1 and its P row (`bytes` at p) zero. */
static inline int64_t tile_keys(int64_t pos, int64_t t, float *alpha, void *p, size_t bytes) {
    const int64_t n = pos - t * NK + 1;
    if (n <= 0) {
        *alpha = 1.f;
        memset(p, 0, bytes);
    }
    return n;
}

__attribute__((target("avx512f"), always_inline)) static inline void softmax_tile(
        __m512 a0, __m512 a1, int64_t n, __m512 scale2, float *m, float *alpha, __m512 *p0, __m512 *p1) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __mmask32 vis = n >= NK ? 0xffffffffu : (__mmask32)((1u << n) - 1);
    const __m512 s0 = _mm512_mul_ps(a0, scale2), s1 = _mm512_mul_ps(a1, scale2);
    const __m512 smax = _mm512_max_ps(_mm512_mask_mov_ps(ninf, (__mmask16)vis, s0),
                                      _mm512_mask_mov_ps(ninf, (__mmask16)(vis >> 16), s1));
    float mt = *m;                                       /* the reference max: moved only past the slack */
    *alpha = 1.f;
    if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(*m + SLACK * LOG2E), _CMP_GT_OQ)) {   /* always on the first tile */
        mt = _mm512_reduce_max_ps(smax);
        *alpha = _mm512_cvtss_f32(pow2_16(_mm512_set1_ps(*m - mt), 0xffff));         /* 0 on the row's first tile */
    }
    const __m512 mv = _mm512_set1_ps(mt);
    *p0 = pow2_16(_mm512_sub_ps(s0, mv), (__mmask16)vis);
    *p1 = pow2_16(_mm512_sub_ps(s1, mv), (__mmask16)(vis >> 16));
    *m = mt;
}
#endif
