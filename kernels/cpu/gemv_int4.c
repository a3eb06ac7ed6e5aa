/* INT4 weight x int8 activation products for decode on x86 CPUs with AVX512-VNNI.
 *
 * The weight format (model/quant/int4_format.py): W[n, k] = (q[n, k] - 8) s[n, g] + z[n, g],
 * q in [0, 15], g = k / G. Activations are quantized per step, per row and per group of G
 * columns, symmetrically to int8 (llama.cpp's Q8_0 idea):
 *
 *   a[m, g] = max |x[m, k in g]|,  sx = a / 127,  xq[m, k] = round(x[m, k] * (127 / a))  in [-127, 127]
 *
 * so that one group of one output row is
 *
 *   sum_k x W ~= sx (s dot(q, xq) + (z - 8 s) sum(xq))
 *
 * with dot(q, xq) exact in int32 (vpdpbusd: unsigned bytes q times signed bytes xq).
 * Weights are repacked once at load so one 64-byte load feeds 16 output rows x 8 columns:
 *
 *   Wq [Np/16][Kp/8][16][4] uint8,  Wq[nb][kb][j][b] = q[16nb+j, 8kb+b] | q[16nb+j, 8kb+4+b] << 4
 *   S, Zc [Np/16][Kp/G][16] float32: s and z - 8 s of rows 16nb..16nb+15
 *
 * 32-bit lane j of a load is row 16nb+j: its low nibbles are columns 8kb..8kb+3, its high
 * nibbles columns 8kb+4..8kb+7, each set a vpdpbusd against 4 broadcast activation bytes.
 * The weight stream is read once per call whatever the row count: activation rows are taken
 * up to 4 at a time inside each 16-row block. Every output row is computed with the same
 * operations in the same order whatever M is: results do not depend on the batch.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_family.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))
/* The weight stream is prefetched int4_lead() bytes ahead into L2 (T1), and on Intel one activation row takes
 * two 16-row blocks side by side (two streams). Into L1 (T0, 1 KiB ahead, here until 2026-11-27) the
 * prefetch held the L1 miss buffers the stream's own loads need. bench-80m INT4 at batch 1 on Zen 4, the
 * C decode step, two interleaved rounds: 2.02 / 1.98 ms with T0, 1.44 / 1.52 ms with T1, 1.44 / 1.44 ms
 * with none (none was kept then). On an AMX Xeon (model 167 under KVM, 2026-11-28), whose hardware
 * prefetchers keep one stream well short of its read bandwidth, bench/kernel_ab.py --kernel gemv_int4
 * (bench-80m's 48 INT4 projections, 9 rounds): two blocks alone 0.93-0.95x; with T1 2 KiB ahead 1 row
 * 0.88-0.91x with the L3 evicted, 0.80-0.82x warm; 4 rows 0.85-0.87x / 0.79-0.80x (1 KiB ahead: 0.89-0.95x,
 * 4 KiB: 0.69-0.97x). */

/* Prefetch lead (bytes): 2,048 (measured above), 8,192 on Zen 5 (AMD family 1Ah; EPYC family 26 model 2
 * under KVM, 2026-11-28, the same kernel_ab case, 11 rounds, three runs against 2,048: 1 row 0.92-0.95x with
 * the L3 evicted, 0.86-0.87x warm; 4 rows 0.82-0.85x / 0.80-0.83x; 4,096 0.90-0.98x at 4 rows and
 * 0.97-1.11x warm at 1 row, 16,384 0.82-0.98x, 1,024 1.07-1.14x slower). */
static int64_t int4_lead(void) {
    static int64_t lead;
    if (!lead) lead = amd_family() == 0x1A ? 8192 : 2048;
    return lead;
}

/* Whether one activation row takes two weight blocks side by side: on Intel (measured above); elsewhere
 * one, as measured on Zen 4 before. */
static int int4_pairs(void) {
    static int pairs = -1;
    if (pairs < 0) { __builtin_cpu_init(); pairs = __builtin_cpu_is("intel"); }
    return pairs;
}

int pd_cpu_supported(void) {                    /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* 16 floats from x (bf16 if is_bf16, else fp32) at columns k..k+15 (< K; zeros past K). */
TARGET INLINE __m512 load16(const void *x, int is_bf16, int64_t k, int64_t K) {
    const int64_t left = K - k;
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    if (is_bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)x + k);
}

/* Quantize rows of x [M, K] (row stride ldx elements; bf16 or fp32) per group of G columns:
 * xq int8 [M, Kp] (columns past K are 0), sx float [M, Kp/G] (a / 127), sxs float [M, Kp/G]
 * (sx * sum of the group's xq). A group of zeros has sx = 0 and xq = 0. Kp % G == 0, G % 16 == 0. */
TARGET void pd_int4_quantize_rows(const void *x, int is_bf16, int64_t M, int64_t K, int64_t ldx, int64_t G,
                                  int64_t Kp, int8_t *xq, float *sx, float *sxs) {
    const int64_t elem = is_bf16 ? 2 : 4, Gs = Kp / G;
    for (int64_t m = 0; m < M; m++) {
        const char *xr = (const char *)x + m * ldx * elem;
        for (int64_t g = 0; g < Gs; g++) {
            __m512 amax = _mm512_setzero_ps();
            __mmask16 nan = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                const __m512 v = load16(xr, is_bf16, k, K);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
            }
            const float a = _mm512_reduce_max_ps(amax);
            int8_t *q = xq + m * Kp + g * G;
            if (nan || !(a > 0)) {               /* zeros: sx = 0; a NaN: sx = NaN, so the row's outputs are NaN */
                memset(q, 0, (size_t)G);         /* (an infinity gives inv = 0, sx = inf: NaN outputs as well) */
                sx[m * Gs + g] = sxs[m * Gs + g] = nan ? __builtin_nanf("") : 0.0f;
                continue;
            }
            const __m512 inv = _mm512_set1_ps(127.0f / a);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr, is_bf16, k, K), inv));  /* nearest-even */
                v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                sum = _mm512_add_epi32(sum, v);
                _mm_storeu_si128((__m128i *)(q + k - g * G), _mm512_cvtepi32_epi8(v));
            }
            const float s = a / 127.0f;
            sx[m * Gs + g] = s;
            sxs[m * Gs + g] = s * (float)_mm512_reduce_add_epi32(sum);
        }
    }
}

/* acc += u8 w . s8 x per 32-bit lane. Inline asm: gcc 12 copies the accumulator around the
 * intrinsic in loops (a register move per product), which costs a third of the decode-step time. */
#ifdef DPBUSD_INTRINSIC
#define DPBUSD(acc, w, x) ((acc) = _mm512_dpbusd_epi32((acc), (w), (x)))
#else
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
#endif

/* 4 activation bytes broadcast to every 32-bit lane. */
TARGET INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* NB (1 or 2) consecutive 16-row weight blocks (each its own stream, side by side) x MR activation rows
 * (MR a constant 1..4 after inlining; NB 2 with MR 1 only: registers). Each output's operations and their
 * order do not depend on NB. */
TARGET INLINE void block_rows(const uint8_t *wb, const float *sb, const float *zb, const int8_t *xq,
                              const float *sx, const float *sxs, int64_t Kp, int64_t G, int MR, int NB,
                              int64_t pf, __m512 out[2][4]) {
    const int64_t Gs = Kp / G, wstride = 16 * (Kp / 2), sstride = 16 * Gs;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 y[2][4], yz[2][4];
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < MR; i++) { y[b][i] = _mm512_setzero_ps(); yz[b][i] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < Gs; g++) {
        __m512i a0[2][4], a1[2][4], a2[2][4], a3[2][4];   /* four int32 chains per row: lo/hi nibbles x even/odd kb */
        for (int b = 0; b < NB; b++)
            for (int i = 0; i < MR; i++) {
                a0[b][i] = _mm512_setzero_si512(); a1[b][i] = _mm512_setzero_si512();
                a2[b][i] = _mm512_setzero_si512(); a3[b][i] = _mm512_setzero_si512();
            }
        for (int64_t kb = 0; kb < G / 8; kb += 2) {
            const int64_t k = g * G + kb * 8;
            for (int b = 0; b < NB; b++) {
                const uint8_t *wg = wb + b * wstride + g * G * 8;      /* G/8 loads of 64 bytes */
                _mm_prefetch((const char *)(wg + kb * 64 + pf), _MM_HINT_T1);
                _mm_prefetch((const char *)(wg + kb * 64 + 64 + pf), _MM_HINT_T1);
                const __m512i w0 = _mm512_loadu_si512(wg + kb * 64), w1 = _mm512_loadu_si512(wg + kb * 64 + 64);
                const __m512i l0 = _mm512_and_si512(w0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low);
                const __m512i l1 = _mm512_and_si512(w1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low);
                for (int i = 0; i < MR; i++) {
                    const int8_t *xr = xq + i * Kp + k;
                    DPBUSD(a0[b][i], l0, bcast4(xr));
                    DPBUSD(a1[b][i], h0, bcast4(xr + 4));
                    DPBUSD(a2[b][i], l1, bcast4(xr + 8));
                    DPBUSD(a3[b][i], h1, bcast4(xr + 12));
                }
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512 s = _mm512_loadu_ps(sb + b * sstride + g * 16), zc = _mm512_loadu_ps(zb + b * sstride + g * 16);
            for (int i = 0; i < MR; i++) {          /* y += (dot sx) s;  yz += zc (sx sum xq) */
                const __m512i d = _mm512_add_epi32(_mm512_add_epi32(a0[b][i], a1[b][i]),
                                                   _mm512_add_epi32(a2[b][i], a3[b][i]));
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sx[i * Gs + g]));
                y[b][i] = _mm512_fmadd_ps(f, s, y[b][i]);
                yz[b][i] = _mm512_fmadd_ps(zc, _mm512_set1_ps(sxs[i * Gs + g]), yz[b][i]);
            }
        }
    }
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < MR; i++) out[b][i] = _mm512_add_ps(y[b][i], yz[b][i]);
}

TARGET INLINE void store16(void *y, int is_bf16, int64_t off, __mmask16 mask, __m512 v) {
    if (is_bf16) {                               /* round to nearest even (NaN kept quiet) */
        __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16((uint16_t *)y + off, mask, _mm512_cvtepi32_epi16(r));
    } else {
        _mm512_mask_storeu_ps((float *)y + off, mask, v);
    }
}

#include "gemm_int4_amx.h"   /* int4_gemm_amx_q, pd_int4_amx_available */

/* y[m, n] (row stride ldy; bf16 if y_bf16 else fp32) for m < M, n < n_valid, from activations
 * quantized by pd_int4_quantize_rows (xq [M, Kp], sx, sxs [M, Kp/G]) and the packed weight
 * (wq [Np/16][Kp/8][16][4], sc / zc [Np/16][Kp/G][16]). G % 16 == 0, Kp % G == 0, Np % 16 == 0.
 * From AMX_INT4_MIN_ROWS rows on a CPU with AMX-INT8 the products run on tiles (gemm_int4_amx.h),
 * bit-identical. */
TARGET void pd_int4_gemv_q(const int8_t *xq, const float *sx, const float *sxs, int64_t M, int64_t Kp, int64_t G,
                           const uint8_t *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                           void *y, int y_bf16, int64_t ldy) {
    if (M >= AMX_INT4_MIN_ROWS && int4_gemm_amx_q(xq, sx, sxs, M, Kp, G, wq, sc, zc, Np, n_valid, y, y_bf16, ldy) == 0)
        return;                                  /* else (no AMX-INT8, or no memory for its scratch) the vectors */
    const int64_t Gs = Kp / G;
    const int pair = M == 1 && int4_pairs();
    const int64_t pf = int4_lead();
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += pair ? 32 : 16) {
        const uint8_t *wb = wq + nb * (Kp / 2);
        const float *sb = sc + nb * Gs, *zb = zc + nb * Gs;
        const int nbl = pair && nb + 16 < Np && nb + 16 < n_valid ? 2 : 1;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mm = M - m0 < 4 ? M - m0 : 4;
            const int8_t *xr = xq + m0 * Kp;
            const float *sr = sx + m0 * Gs, *tr = sxs + m0 * Gs;
            __m512 out[2][4];
            switch (nbl == 2 ? 0 : mm) {          /* constant row counts: registers, not arrays */
            case 0: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 1, 2, pf, out); break;
            case 1: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 1, 1, pf, out); break;
            case 2: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 2, 1, pf, out); break;
            case 3: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 3, 1, pf, out); break;
            default: block_rows(wb, sb, zb, xr, sr, tr, Kp, G, 4, 1, pf, out); break;
            }
            for (int b = 0; b < nbl; b++) {
                const int64_t cnt = n_valid - nb - 16 * b < 16 ? n_valid - nb - 16 * b : 16;
                const __mmask16 mask = (__mmask16)((1u << cnt) - 1);
                for (int i = 0; i < mm; i++) store16(y, y_bf16, (m0 + i) * ldy + nb + 16 * b, mask, out[b][i]);
            }
        }
    }
}

#include "int4_gemv.h"

/* As pd_int4_gemv, always on AMX-INT8 tiles at any row count (tests and benchmarks compare it with the VNNI
 * kernel; pd_int4_gemv takes it from AMX_INT4_MIN_ROWS rows). Returns 0, -1 if out of memory, -2 if AMX-INT8
 * is not usable here. */
int pd_int4_gemm_amx(const void *x, int x_bf16, int64_t M, int64_t K, int64_t ldx, int64_t Kp, int64_t G,
                     const uint8_t *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                     void *y, int y_bf16, int64_t ldy) {
    if (!int4_amx_granted()) return -2;
    int8_t *xq;
    float *sx, *sxs;
    if (int4_quantized(x, x_bf16, M, K, ldx, Kp, G, &xq, &sx, &sxs)) return -1;
    return int4_gemm_amx_q(xq, sx, sxs, M, Kp, G, wq, sc, zc, Np, n_valid, y, y_bf16, ldy);
}
