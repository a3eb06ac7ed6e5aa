/* exp on 16 float32 lanes, inline, for the attention kernels' softmax (prefill_attention.c,
 * paged_attention.c). A libmvec call there spilled the score accumulators and queries around it.
 *
 * x clamped at -104 (exp(-104) rounds to 0, so -inf, a masked key, gives 0), x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 in two parts), e^r by the degree-6 polynomial of Cephes' expf (within ~1 ulp, as
 * glibc's), times 2^n by vscalefps (exact scaling, denormal results as expf's). Meant for x <= ~88
 * (the kernels call it on scores minus a reference max, at most their SLACK). Included by the kernels
 * only; kernels/cpu/__init__.py keys its build cache on this header too.
 */
#ifndef PD_EXP16_H
#define PD_EXP16_H
#include <immintrin.h>

static inline __attribute__((always_inline, target("avx512f"))) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), 0x08);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

#endif
