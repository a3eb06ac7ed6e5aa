/* bf16 <-> float32 conversions shared by the CPU kernels, and the AVX2 kernels' 8-lane reductions
 * (included; kernels/cpu/__init__.py keys its build cache on this header too). bf16 is the upper half of a float32: widening is exact; narrowing
 * rounds to nearest even, as torch's .to(torch.bfloat16) does, and keeps NaN a quiet NaN. */
#ifndef PD_BF16_H
#define PD_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#if defined(__x86_64__)
#include <immintrin.h>

/* 16 pairs of bf16 (one 64-byte load) widened to float32, exactly: the even elements (each lane's low
 * half shifted up) and the odd ones (its high half, masked): the packed GEMMs' and the attention
 * kernels' way to feed bf16 pairs to float32 FMAs. */
__attribute__((target("avx512f"))) static inline __m512 bf16_even_f32(__m512i w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
__attribute__((target("avx512f"))) static inline __m512 bf16_odd_f32(__m512i w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The same on 8 pairs (one 32-byte load), for the AVX2 kernels (gemm_bf16_avx2.c, prefill_attention_avx2.c). */
__attribute__((target("avx2"))) static inline __m256 bf16_even8(__m256i w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
__attribute__((target("avx2"))) static inline __m256 bf16_odd8(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The largest of 8 lanes (exact), and their sum as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)). */
__attribute__((target("avx2"))) static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
__attribute__((target("avx2"))) static inline float hadd8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* f32_to_bf16 on 8 lanes, packed to 8 uint16 (nearest even; NaN stays a quiet NaN). */
__attribute__((target("avx2"))) static inline __m128i f32_to_bf16_x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

/* f32_to_bf16 on 16 lanes: each lane's bf16 bits in its low half (narrow with _mm512_cvtepi32_epi16). */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i f32_to_bf16_x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
#endif

#endif
