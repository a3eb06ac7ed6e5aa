/* INT4 weight x int8 activation products on AVX2, for x86 CPUs without AVX512-VNNI: gemv_int4.c's
 * formats, arithmetic and results on 8-lane vectors (the same symbols, so a caller loads one library
 * or the other).
 *
 * gemv_int4.c's vpdpbusd (4 unsigned weight bytes times 4 signed activation bytes, summed into an
 * int32 lane) becomes vpmaddubsw (pairs summed into int16) then vpmaddwd against ones (pairs of
 * int16 into int32). vpmaddubsw saturates at 2^15, which these products never reach: weights are in
 * [0, 15] and activations in [-127, 127], so one pair sums to at most 3,810 in magnitude, and the
 * four nibble sets of 16 columns summed in int16 before the widening to at most 15,240. Integer sums
 * are exact in any order, so every group's dot product equals gemv_int4.c's, and the float steps
 * that follow (scale, zero correction, their order) are the same per lane: outputs are bit-identical
 * to the AVX512-VNNI kernel's, and do not depend on the batch.
 *
 * Weight layout (model/quant/int4_format.py, kernels/cpu/int4.py): one 64-byte row of Wq holds 16
 * output rows x 8 columns; its 32-byte halves are rows 0-7 and 8-15 of the block.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define TARGET __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define PREFETCH_BYTES 1024                     /* ahead in the weight stream */

int pd_cpu_supported(void) {                    /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* 8 floats from x (bf16 if is_bf16, else fp32) at columns k..k+7 (zeros at and past K). */
TARGET INLINE __m256 load8(const void *x, int is_bf16, int64_t k, int64_t K) {
    if (K - k >= 8) {
        if (is_bf16)
            return _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + k))), 16));
        return _mm256_loadu_ps((const float *)x + k);
    }
    float v[8] = {0};
    for (int64_t j = k; j < K; j++) v[j - k] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
    return _mm256_loadu_ps(v);
}

TARGET INLINE int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* As gemv_int4.c: per row and group of G columns, a = max |x|, xq = round(x * 127 / a) (nearest even,
 * clamped to [-127, 127]), sx = a / 127, sxs = sx * sum(xq); a NaN makes sx NaN, zeros make it 0. */
TARGET void pd_int4_quantize_rows(const void *x, int is_bf16, int64_t M, int64_t K, int64_t ldx, int64_t G,
                                  int64_t Kp, int8_t *xq, float *sx, float *sxs) {
    const int64_t elem = is_bf16 ? 2 : 4, Gs = Kp / G;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++) {
        const char *xr = (const char *)x + m * ldx * elem;
        for (int64_t g = 0; g < Gs; g++) {
            __m256 amax = _mm256_setzero_ps();
            int nan = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                const __m256 v = load8(xr, is_bf16, k, K);
                nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                amax = _mm256_max_ps(amax, _mm256_and_ps(v, absmask));
            }
            const float a = hmax8(amax);
            int8_t *q = xq + m * Kp + g * G;
            if (nan || !(a > 0)) {
                memset(q, 0, (size_t)G);
                sx[m * Gs + g] = sxs[m * Gs + g] = nan ? __builtin_nanf("") : 0.0f;
                continue;
            }
            const __m256 inv = _mm256_set1_ps(127.0f / a);
            __m256i sum = _mm256_setzero_si256();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr, is_bf16, k, K), inv));     /* nearest-even */
                v = _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
                sum = _mm256_add_epi32(sum, v);
                const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storel_epi64((__m128i *)(q + k - g * G), _mm_packs_epi16(w16, w16));
            }
            const float s = a / 127.0f;
            sx[m * Gs + g] = s;
            sxs[m * Gs + g] = s * (float)hsum8_epi32(sum);
        }
    }
}

/* 4 activation bytes broadcast to every 32-bit lane. */
TARGET INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Half h (rows 8h .. 8h + 7) of one 16-row weight block x MR activation rows (MR a constant 1..4). */
TARGET INLINE void block_rows(const uint8_t *wb, const float *sb, const float *zb, const int8_t *xq,
                              const float *sx, const float *sxs, int64_t Kp, int64_t G, int MR, int h,
                              __m256 out[4]) {
    const int64_t Gs = Kp / G;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 y[4], yz[4];
    for (int i = 0; i < MR; i++) { y[i] = _mm256_setzero_ps(); yz[i] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < Gs; g++) {
        __m256i d[4];                           /* one int32 sum per row and lane: exact in any order */
        for (int i = 0; i < MR; i++) d[i] = _mm256_setzero_si256();
        const uint8_t *wg = wb + g * G * 8 + 32 * h;
        for (int64_t kb = 0; kb < G / 8; kb += 2) {
            _mm_prefetch((const char *)(wg + kb * 64 + PREFETCH_BYTES), _MM_HINT_T0);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wg + kb * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + kb * 64 + 64));
            const __m256i l0 = _mm256_and_si256(w0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
            const __m256i l1 = _mm256_and_si256(w1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
            const int64_t k = g * G + kb * 8;
            for (int i = 0; i < MR; i++) {
                const int8_t *xr = xq + i * Kp + k;
                __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(l0, bcast4(xr)), _mm256_maddubs_epi16(h0, bcast4(xr + 4)));
                t = _mm256_add_epi16(t, _mm256_add_epi16(_mm256_maddubs_epi16(l1, bcast4(xr + 8)),
                                                         _mm256_maddubs_epi16(h1, bcast4(xr + 12))));
                d[i] = _mm256_add_epi32(d[i], _mm256_madd_epi16(t, ones));
            }
        }
        const __m256 s = _mm256_loadu_ps(sb + g * 16 + 8 * h), zc = _mm256_loadu_ps(zb + g * 16 + 8 * h);
        for (int i = 0; i < MR; i++) {          /* y += (dot sx) s;  yz += zc (sx sum xq) */
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(d[i]), _mm256_set1_ps(sx[i * Gs + g]));
            y[i] = _mm256_fmadd_ps(f, s, y[i]);
            yz[i] = _mm256_fmadd_ps(zc, _mm256_set1_ps(sxs[i * Gs + g]), yz[i]);
        }
    }
    for (int i = 0; i < MR; i++) out[i] = _mm256_add_ps(y[i], yz[i]);
}

/* The first cnt (<= 8) lanes of v to y at element off (bf16 rounded to nearest even, NaN kept quiet). */
TARGET INLINE void store8(void *y, int is_bf16, int64_t off, int64_t cnt, __m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int64_t j = 0; j < cnt; j++) {
        if (is_bf16) ((uint16_t *)y)[off + j] = f32_to_bf16(f[j]);
        else ((float *)y)[off + j] = f[j];
    }
}

/* As gemv_int4.c's pd_int4_gemv_q. */
TARGET void pd_int4_gemv_q(const int8_t *xq, const float *sx, const float *sxs, int64_t M, int64_t Kp, int64_t G,
                           const uint8_t *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                           void *y, int y_bf16, int64_t ldy) {
    const int64_t Gs = Kp / G;
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 16) {
        const uint8_t *wb = wq + nb * (Kp / 2);
        const float *sb = sc + nb * Gs, *zb = zc + nb * Gs;
        for (int h = 0; h < 2; h++) {
            const int64_t n0 = nb + 8 * h, cnt = n_valid - n0 < 8 ? n_valid - n0 : 8;
            if (cnt <= 0) break;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t mm = M - m0 < 4 ? M - m0 : 4;
                const int8_t *xr = xq + m0 * Kp;
                const float *sr = sx + m0 * Gs, *tr = sxs + m0 * Gs;
                __m256 out[4];
                switch (mm) {                     /* constant row counts: registers, not arrays */
                case 1: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 1, h, out); break;
                case 2: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 2, h, out); break;
                case 3: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 3, h, out); break;
                default: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 4, h, out); break;
                }
                for (int i = 0; i < mm; i++) store8(y, y_bf16, (m0 + i) * ldy + n0, cnt, out[i]);
            }
        }
    }
}

#include "int4_gemv.h"
