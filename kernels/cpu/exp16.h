/* exp on 16 float32 lanes, inline, for the decode attention's softmax (paged_attention.c) and SiLU (fused.c);
 * exp8 below: the same on 8 lanes for the AVX2 attention paths (the AVX-512 prefill kernels walk in base 2:
 * prefill_softmax.h). A libmvec call there
 * spilled the score accumulators and queries around it.
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by the degree-6 polynomial of Cephes'
 * expf (within ~1 ulp, as glibc's), times 2^n by vscalefps (exact scaling). Below x = -87 the result
 * is exactly 0 (e^-87 = 1.6e-38, near FLT_MIN; -inf, a masked key, and NaN give 0 too), and x is
 * clamped there first, so no lane makes a subnormal result or intermediate: Intel cores take a
 * microcode assist of ~150 cycles on each instruction that does, with MXCSR's flush-to-zero off, as
 * it is in a torch process (tests/test_cpu_kernels.py). Until 2026-11-28 x was clamped at -104, and a
 * decode page whose last lanes were masked (every sequence's last page but one in sixteen) took
 * 2.3x the time of a full page on the Xeon model 207 (442 vs 192 ns for 16 tokens x 3 heads). The
 * results for x >= -87 are bit-identical to that version's; below, it gave subnormals under 1.6e-38,
 * which a softmax whose denominator is at least 1 cannot see. Meant for x <= ~88 (the kernels call it
 * on scores minus a reference max, at most their SLACK). Included by the kernels only;
 * kernels/cpu/__init__.py keys its build cache on this header too.
 */
#ifndef PD_EXP16_H
#define PD_EXP16_H
#include <immintrin.h>

#define EXP_FLOOR -87.f                     /* below: 0 exactly (no subnormal anywhere) */

static inline __attribute__((always_inline, target("avx512f"))) __m512 exp16(__m512 x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
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
    return _mm512_maskz_scalef_ps(normal, p, n);
}

/* exp16 on 8 lanes for the AVX2 kernels (prefill_attention_avx2.c), lane for lane the same result: AVX2
 * has no vscalefps, so 2^n is applied as two exact powers of two, 2^(n >> 1) then 2^(n - (n >> 1)), each
 * a normal float for n in [-126, 128]; the first product is exact, the second rounds once, as vscalefps. */
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 exp8(__m256 x) {
    const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
    return _mm256_and_ps(normal, p);
}

#endif
