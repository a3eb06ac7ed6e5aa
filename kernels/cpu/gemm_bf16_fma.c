/* bf16 GEMM on float32 FMAs, for AVX-512 CPUs where vdpbf16ps is slow (or absent).
 *
 * On an Emerald Rapids core under KVM a zmm vdpbf16ps issues once per ~2.2 cycles while zmm FMAs
 * issue twice per cycle (`pd_dp_fma_ratio` below measures it: 4.1 there, about 1 on Zen 4 and
 * Zen 5): a dot-product GEMM peaks at ~29 FLOP/cycle there, float32 FMAs at 64. This kernel reads
 * the same packed weights as gemv_bf16.c and widens each 64-byte load (16 outputs x 2 input
 * columns) into two float32 vectors with one shift and one mask (bf16 is the upper half of a
 * float32):
 *
 *   Wp[nb][kk][j][e] = W[16 nb + j, 2 kk + e]
 *   w_even = Wp << 16, w_odd = Wp & 0xffff0000             (16 lanes each, exact)
 *   acc[m][j] = fma(x[m, 2kk + 1], w_odd, fma(x[m, 2kk], w_even, acc[m][j]))
 *
 * with x widened to float32 once per call (a few hundred KiB, in L2) so that each activation enters
 * the FMA as a broadcast memory operand. Blocking as pd_gemm_bf16_avx512: weight panels of FNR x 16
 * outputs, FKC pairs of input columns per chunk (the panel chunk stays in L1 across row tiles),
 * FMR x FNR accumulators per tile (8 x 3: 24 accumulators and 6 widened weight vectors fill 30 of the
 * 32 registers; each widened weight feeds 8 rows, so the shift and mask that share the FMA ports cost
 * 1/8 of the FMAs: 8 rows per tile ran 9% faster than 6 at 32 rows, 17% at 8, on the Xeon model 207),
 * float32 partial sums between chunks (exact). One chain per
 * output, summed in k order: a row's result depends only on that row (batch-invariant), but it
 * differs from the dot-product kernels' rounding, so a CPU runs one family for every row count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "bf16.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define FMR 8                                      /* rows per tile */
#define FNR 3                                      /* 16-output blocks per panel: 24 accumulators */
#define FKC 128                                    /* kk pairs per k chunk (24 KiB of panel in L1) */
#define FPF 1024                                   /* elements of prefetch lead per weight stream */
#define X_BUDGET (1 << 18)                         /* float32 activations widened per pass (1 MiB) */

int pd_cpu_supported(void) {                       /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

TARGET static inline __attribute__((always_inline)) void fma_tile(
        const int mr, const int nr, const float *xf, int64_t K, int64_t k0, int64_t kn,
        const uint16_t *wb, const uint16_t *pn, float *cb, int first, int last, uint16_t *y, int64_t ldy,
        int64_t nb, int64_t n_valid) {
    __m512 acc[FMR][FNR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cb + (i * FNR + j) * 16);
    const uint16_t *ws = wb + k0 * 32;              /* block j of the panel at ws + j * 16 * K */
    const float *xs = xf + 2 * k0;
    for (int64_t kk = 0; kk < kn; kk++) {
        __m512 we[FNR], wo[FNR];
        if (pn) _mm_prefetch((const char *)(pn + kk * 32), _MM_HINT_T1);
        for (int j = 0; j < nr; j++) {
            _mm_prefetch((const char *)(ws + j * 16 * K + kk * 32 + FPF), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(ws + j * 16 * K + kk * 32);
            we[j] = bf16_even_f32(w);
            wo[j] = bf16_odd_f32(w);
        }
        for (int i = 0; i < mr; i++) {
            const __m512 xe = _mm512_set1_ps(xs[i * K + 2 * kk]), xo = _mm512_set1_ps(xs[i * K + 2 * kk + 1]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xo, wo[j], _mm512_fmadd_ps(xe, we[j], acc[i][j]));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            if (!last) { _mm512_storeu_ps(cb + (i * FNR + j) * 16, acc[i][j]); continue; }
            const int64_t n = nb + 16 * j, cnt = n_valid - n < 16 ? n_valid - n : 16;
            if (cnt <= 0) continue;
            _mm256_mask_storeu_epi16(y + i * ldy + n, (__mmask16)((1u << cnt) - 1),
                                     _mm512_cvtepi32_epi16(f32_to_bf16_x16(acc[i][j])));
        }
}

#define TILE(MR, NR) fma_tile(MR, NR, xf + m0 * K, K, k0, kn, wb, pn, cb, first, last, y + m0 * ldy, ldy, \
                                  nb, n_valid)
#define ROWS(NR) switch (mr) { case 1: TILE(1, NR); break; case 2: TILE(2, NR); break;              \
                               case 3: TILE(3, NR); break; case 4: TILE(4, NR); break;              \
                               case 5: TILE(5, NR); break; case 6: TILE(6, NR); break;              \
                               case 7: TILE(7, NR); break; default: TILE(FMR, NR); }

/* One k chunk of one weight panel over the mc widened rows xf; nr and mr compile-time per instance. Every
 * row tile prefetches its own stream FPF elements ahead: the first tile brings the chunk's lines, the
 * others find them in cache. With several tiles, tile t (t < nrn) also brings block t of the next chunk
 * (wn: this panel's next pairs, else the next panel's first) into L2, a line per k step: the first tile
 * alone had read each chunk from memory in a burst (24 KiB in the time of one tile's FMAs) and left the
 * bus idle while the others computed. bench-80m's 48 projections from DRAM or L3 on a Xeon model 207
 * without AVX512-BF16 (bench/kernel_ab.py, interleaved, medians of 11-15, 2026-12-01): 16 rows 0.925-0.947x,
 * 32 rows 0.911-0.983x over four runs, 128 rows 0.97-1.0x, 512 rows 0.86-1.0x; the batch-32 decode step
 * 0.947x (bench/step_ab.py, medians of 5 processes).
 * (chunk_ahead.h's share of the next chunk spread over every tile, with its per-step bookkeeping, had
 * been 1.4-2x slower from 16 to 128 rows on a Cascade Lake core and 2-8% slower at 8-128 rows on that
 * Xeon model 207: 32 rows 45.8 ms own stream, 49.3 shared, 49.1 both; median of 9, 2026-11-28.) */
TARGET static void fma_chunk(const int nr, const float *xf, int64_t mc, int64_t K, int64_t k0, int64_t kn,
                             const uint16_t *wb, const uint16_t *wn, int64_t nrn, float *cbuf, int first, int last,
                             uint16_t *y, int64_t ldy, int64_t nb, int64_t n_valid) {
    for (int64_t m0 = 0; m0 < mc; m0 += FMR) {
        const int mr = mc - m0 < FMR ? (int)(mc - m0) : FMR;
        float *cb = cbuf + m0 * FNR * 16;
        const int64_t t = m0 / FMR;                /* tile t brings block t of the next chunk into L2 */
        const uint16_t *pn = wn && mc > FMR && t < nrn ? wn + t * 16 * K : NULL;
        if (nr == FNR) { ROWS(FNR) }
        else if (nr == 2) { ROWS(2) }
        else { ROWS(1) }
    }
}

/* y[m, n] (bf16, row stride ldy) = sum_k x[m, k] W[n, k] for m < M, n < n_valid; arguments as
 * pd_gemv_bf16 (x bf16 [M, K] with row stride ldx, K even; wp packed [Np/16][K/2][16][2]).
 * Returns 0, or -1 if the widened rows and partial sums could not be allocated. */
TARGET int pd_gemm_bf16_fma(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                            const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y, int64_t ldy) {
    const int64_t K2 = K / 2;
    if (M <= 0) return 0;                          /* nothing to widen (aligned_alloc(.., 0) may be NULL) */
    int64_t rows = X_BUDGET / (K > 0 ? K : 1);
    rows = rows < FMR ? FMR : rows > 256 ? 256 : rows;
    rows = rows < M ? rows : M;
    float *xf = aligned_alloc(64, ((size_t)(rows * K) * sizeof(float) + 63) / 64 * 64);
    float *cbuf = aligned_alloc(64, (size_t)((rows + FMR) * FNR * 16) * sizeof(float));
    if (!xf || !cbuf) { free(xf); free(cbuf); return -1; }
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mc = M - m0 < rows ? M - m0 : rows;
        for (int64_t i = 0; i < mc; i++)              /* widen: bf16 -> float32 is a 16-bit shift */
            for (int64_t k = 0; k < K; k += 16) {
                const __mmask16 m = (__mmask16)(K - k >= 16 ? 0xffff : (1u << (K - k)) - 1);
                const __m256i h = _mm256_maskz_loadu_epi16(m, x + (m0 + i) * ldx + k);
                _mm512_mask_storeu_ps(xf + i * K + k, m, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
        for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 16 * FNR) {
            const int64_t left = (Np - nb) / 16, nr = left < FNR ? left : FNR;
            for (int64_t k0 = 0; k0 < K2; k0 += FKC) {
                const int64_t kn = K2 - k0 < FKC ? K2 - k0 : FKC, nn = nb + 16 * FNR;
                const uint16_t *wn = NULL;         /* the next chunk: this panel's next pairs, else the next panel's */
                int64_t nrn = nr;
                if (k0 + kn < K2) wn = wp + nb * K + (k0 + kn) * 32;
                else if (nn < Np && nn < n_valid) wn = wp + nn * K, nrn = (Np - nn) / 16 < FNR ? (Np - nn) / 16 : FNR;
                fma_chunk((int)nr, xf, mc, K, k0, kn, wp + nb * K, wn, nrn, cbuf, k0 == 0, k0 + kn == K2,
                          y + m0 * ldy, ldy, nb, n_valid);
            }
        }
    }
    free(xf);
    free(cbuf);
    return 0;
}

/* Time of `n` x 12 independent zmm vdpbf16ps over the time of as many zmm FMAs, best of 3 (about
 * 1 ms each on a 3 GHz core for n = 100000): how much slower the dot product issues than the FMA.
 * 0 if this CPU lacks AVX512-BF16. Each loop is 12 accumulator chains in registers (named, so the
 * compiler keeps them there), enough to cover either instruction's latency at two per cycle, in asm
 * so that it stays as written. The inputs are non-zero bf16 pairs (0, 1). */
#define CHAINS(INSN) __asm__ volatile(                                                                  \
        INSN " %12, %12, %0\n\t" INSN " %12, %12, %1\n\t" INSN " %12, %12, %2\n\t" INSN " %12, %12, %3\n\t" \
        INSN " %12, %12, %4\n\t" INSN " %12, %12, %5\n\t" INSN " %12, %12, %6\n\t" INSN " %12, %12, %7\n\t" \
        INSN " %12, %12, %8\n\t" INSN " %12, %12, %9\n\t" INSN " %12, %12, %10\n\t" INSN " %12, %12, %11" \
        : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),       \
          "+v"(a9), "+v"(a10), "+v"(a11) : "v"(x))
#define TIMED_LOOP(INSN)                                                                                \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,    \
           a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                                        \
    const __m512 x = _mm512_set1_ps(1.f);                                                               \
    struct timespec t0, t1;                                                                             \
    clock_gettime(CLOCK_MONOTONIC, &t0);                                                                \
    for (int64_t i = 0; i < n; i++) CHAINS(INSN);                                                       \
    clock_gettime(CLOCK_MONOTONIC, &t1);                                                                \
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec)

__attribute__((target("avx512f,avx512bf16"))) static double dp_loop(int64_t n) { TIMED_LOOP("vdpbf16ps"); }
TARGET static double fma_loop(int64_t n) { TIMED_LOOP("vfmadd231ps"); }

double pd_dp_fma_ratio(int64_t n) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !pd_cpu_supported()) return 0.0;
    double dp = 1e30, fma = 1e30;
    for (int r = 0; r < 3; r++) {
        const double d = dp_loop(n), f = fma_loop(n);
        dp = d < dp ? d : dp;
        fma = f < fma ? f : fma;
    }
    return dp / fma;
}
