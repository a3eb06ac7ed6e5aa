/* The online-softmax step of one query row over one 32-key tile, shared by the AVX-512 prefill attention
 * kernels (prefill_attention.c, prefill_attention_amx.c; FlashAttention's, Dao et al., 2022): scale the
 * raw scores, mask keys past the row's n visible ones (n >= 1), move the reference max only when a score
 * passes it by SLACK (then alpha = exp(m - m'), else 1), and return P = exp(S - m) for keys 0-15 and 16-31.
 * The including file defines NK (32) and SLACK and includes exp16.h first. */
#ifndef PD_PREFILL_SOFTMAX_H
#define PD_PREFILL_SOFTMAX_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

__attribute__((target("avx512f"), always_inline)) static inline void softmax_tile(
        __m512 a0, __m512 a1, int64_t n, __m512 scale, float *m, float *alpha, __m512 *p0, __m512 *p1) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __mmask32 vis = n >= NK ? 0xffffffffu : (__mmask32)((1u << n) - 1);
    const __m512 s0 = _mm512_mask_mov_ps(ninf, (__mmask16)vis, _mm512_mul_ps(a0, scale));
    const __m512 s1 = _mm512_mask_mov_ps(ninf, (__mmask16)(vis >> 16), _mm512_mul_ps(a1, scale));
    const __m512 smax = _mm512_max_ps(s0, s1);
    float mt = *m;                                       /* the reference max: moved only past the slack */
    *alpha = 1.f;
    if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(*m + SLACK), _CMP_GT_OQ)) {    /* always on the first tile */
        mt = _mm512_reduce_max_ps(smax);
        *alpha = _mm512_cvtss_f32(exp16(_mm512_set1_ps(*m - mt)));            /* 0 on the row's first tile */
    }
    const __m512 mv = _mm512_set1_ps(mt);
    *p0 = exp16(_mm512_sub_ps(s0, mv));
    *p1 = exp16(_mm512_sub_ps(s1, mv));
    *m = mt;
}
#endif
