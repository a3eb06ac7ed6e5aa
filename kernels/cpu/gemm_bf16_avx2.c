/* bf16 GEMM on AVX2 float32 FMAs, for x86 CPUs without AVX-512 (AMD Zen 2 / Zen 3, Intel before Ice
 * Lake, client cores): the packed layout of gemv_bf16.c read as in gemm_bf16_fma.c, on 8-lane vectors.
 *
 *   Wp[nb][kk][j][e] = W[16 nb + j, 2 kk + e]          one 64-byte pair row = two 32-byte halves
 *   half h (outputs 8h .. 8h + 7):  w_even = Wp << 16, w_odd = Wp & 0xffff0000   (8 lanes each, exact)
 *   acc[m][h] = fma(x[m, 2kk + 1], w_odd, fma(x[m, 2kk], w_even, acc[m][h]))
 *
 * Sixteen ymm registers. A tile of 5-6 rows holds 2 accumulators a row (12), two widened halves and one
 * broadcast activation (15 in all): a k pair runs in two phases, the even k for every row, then the odd
 * k, each widening its two halves from the 64-byte pair row again (an L1 load; odd halves by two shifts,
 * so no register holds a mask), so that each widened weight feeds 6 rows and 12 independent chains hide
 * the FMA latency. A tile of up to 4 rows holds the four halves at once (8 chains, exactly the latency's
 * worth at two FMAs a cycle). The widened activations are interleaved by tile (widen()), so a tile's
 * broadcasts read one pointer at constant offsets. Against the 4-row form on a Zen 3 core, interleaved,
 * best of 15 (bench-80m's four projection shapes, hot): 8 rows 0.92x the time, 13 rows 0.83x, 32 rows
 * 0.93x, 512 rows 0.86x; 1 and 2 rows unchanged (bench/kernel_ab.py --kernel gemm_bf16_avx2, L3 evicted,
 * on a noisy host: 0.90-0.95x at 8 and 32 rows, 0.90-0.96x at 512). x is widened to float32
 * once per call; the weight panel is walked in chunks of AKC pairs (16 KiB, kept in L1 across the
 * row tiles), float32 partial sums between chunks. One chain per output in k order, rounded once to
 * bf16 (nearest even): the same arithmetic in the same order as gemm_bf16_fma.c, so a result is
 * bit-identical to the AVX-512 FMA kernel's, and a row's result does not depend on the batch. A pass of
 * one row takes two panels at a time (four chains rather than two: the chains' FMA latency, not the
 * memory, bounded one row).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "chunk_ahead.h"

#define TARGET __attribute__((target("avx2,fma")))
#define AMR 6                                      /* rows per tile at most */
#define AKC 256                                    /* kk pairs per k chunk (16 KiB of panel in L1) */
#define APF 512                                    /* elements of prefetch lead on the weight stream */
#define X_BUDGET (1 << 18)                         /* float32 activations widened per pass (1 MiB) */

int pd_cpu_supported(void) {                       /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* After a tile: rows x 16 float32 sums in out (row stride 16) go to the partial-sum buffer cb, or, at the
 * last chunk, rounded to bf16 into y (outputs nb .. nb + 15 below n_valid). The tiles copy their
 * accumulators to out with constant indices, so that gcc keeps them in registers inside the k loop. */
TARGET static void tile_out(const float *out, int mr, float *cb, int last, uint16_t *y, int64_t ldy, int64_t nb,
                            int64_t n_valid) {
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_loadu_ps(out + i * 16 + 8 * h);
            if (!last) { _mm256_storeu_ps(cb + i * 16 + 8 * h, v); continue; }
            const int64_t n = nb + 8 * h, cnt = n_valid - n < 8 ? n_valid - n : 8;
            if (cnt <= 0) continue;
            const __m128i b = f32_to_bf16_x8(v);
            if (cnt == 8) { _mm_storeu_si128((__m128i *)(y + i * ldy + n), b); continue; }
            uint16_t tmp[8];
            _mm_storeu_si128((__m128i *)tmp, b);
            for (int64_t c = 0; c < cnt; c++) y[i * ldy + n + c] = tmp[c];
        }
}

/* bf16_odd8 by two shifts rather than an and with a mask: no register kept for the mask. */
TARGET static inline __m256 bf16_odd8_shift(__m256i w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w, 16), 16));
}

TARGET static inline __attribute__((always_inline)) void tile(
        const int mr, const int pf, const float *xs, int64_t K, int64_t kn, const uint16_t *ws, float *cb,
        int first, int last, uint16_t *y, int64_t ldy, int64_t nb, int64_t n_valid, Ahead ahead) {
    __m256 acc[AMR][2];
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(cb + i * 16 + 8 * h);
    for (int64_t kk = 0; kk < kn; kk++) {
        if (pf) _mm_prefetch((const char *)(ws + kk * 32 + APF), _MM_HINT_T0);
        ahead_step(&ahead);
        const __m256i *wk = (const __m256i *)(ws + kk * 32);
        const float *xk = xs + kk * 2 * mr;            /* this pair's values of the tile's rows, one line */
        if (mr <= 4) {                                 /* few rows: the four halves at once, 2 FMAs a chain */
            const __m256i w0 = _mm256_loadu_si256(wk), w1 = _mm256_loadu_si256(wk + 1);
            const __m256 e0 = bf16_even8(w0), o0 = bf16_odd8(w0), e1 = bf16_even8(w1), o1 = bf16_odd8(w1);
            for (int i = 0; i < mr; i++) {
                const __m256 xe = _mm256_broadcast_ss(xk + 2 * i), xo = _mm256_broadcast_ss(xk + 2 * i + 1);
                acc[i][0] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, acc[i][0]));
                acc[i][1] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, acc[i][1]));
            }
            continue;
        }
        const __m256 e0 = bf16_even8(_mm256_loadu_si256(wk)), e1 = bf16_even8(_mm256_loadu_si256(wk + 1));
        for (int i = 0; i < mr; i++) {
            const __m256 xe = _mm256_broadcast_ss(xk + 2 * i);
            acc[i][0] = _mm256_fmadd_ps(xe, e0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xe, e1, acc[i][1]);
        }
        __asm__ volatile("" ::: "memory");         /* reload the pair row: no register holds it across */
        const __m256 o0 = bf16_odd8_shift(_mm256_loadu_si256(wk)), o1 = bf16_odd8_shift(_mm256_loadu_si256(wk + 1));
        for (int i = 0; i < mr; i++) {
            const __m256 xo = _mm256_broadcast_ss(xk + 2 * i + 1);
            acc[i][0] = _mm256_fmadd_ps(xo, o0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xo, o1, acc[i][1]);
        }
    }
    float out[AMR * 16] __attribute__((aligned(32)));
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) _mm256_store_ps(out + i * 16 + 8 * h, acc[i][h]);
    tile_out(out, mr, cb, last, y, ldy, nb, n_valid);
}

/* One row against two 16-output panels (ws and ws2): four independent chains instead of two, so that a
 * single row (decode at batch 1) is not bound by the FMA latency of its chains (each output's chain and
 * its order are those of tile(), so the bits are the same). */
TARGET static void row_two_panels(const float *xs, int64_t kn, const uint16_t *ws, const uint16_t *ws2, float *cb,
                                  int first, int last, uint16_t *y, int64_t nb, int64_t n_valid) {
    __m256 acc[4];
    for (int h = 0; h < 4; h++) acc[h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(cb + 8 * h);
    for (int64_t kk = 0; kk < kn; kk++) {
        _mm_prefetch((const char *)(ws + kk * 32 + APF), _MM_HINT_T0);
        _mm_prefetch((const char *)(ws2 + kk * 32 + APF), _MM_HINT_T0);
        const __m256 xe = _mm256_broadcast_ss(xs + 2 * kk), xo = _mm256_broadcast_ss(xs + 2 * kk + 1);
        for (int h = 0; h < 4; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)((h < 2 ? ws : ws2) + kk * 32 + 16 * (h & 1)));
            acc[h] = _mm256_fmadd_ps(xo, bf16_odd8(w), _mm256_fmadd_ps(xe, bf16_even8(w), acc[h]));
        }
    }
    float out[32] __attribute__((aligned(32)));
    for (int h = 0; h < 4; h++) _mm256_store_ps(out + 8 * h, acc[h]);
    tile_out(out, 1, cb, last, y, 0, nb, n_valid);                  /* outputs nb .. nb + 15 */
    tile_out(out + 16, 1, cb + 16, last, y, 0, nb + 16, n_valid);    /* nb + 16 .. nb + 31 */
}

#define TILE(MR, PF) tile(MR, PF, xs + m0 * K + 2 * k0 * (MR), K, kn, ws, cb + m0 * 16, first, last, y + m0 * ldy, ldy, \
                          nb, n_valid, ahead_share(next, t, tiles, kn))

#define MAX_TILES 128                              /* tiles of one pass (256 rows) at most */

/* The row counts of the tiles of mc rows (in sizes; returns how many): tiles of AMR rows, a remainder of
 * 4-5 rows a tile of its own, one of 1-3 joined to the last full tile and the two split evenly (32: 6 6 6 6
 * 4 4; 7: 4 3; 13: 6 4 3). Hot A/B on Zen 3 (bench-80m's four projection shapes, best of 15, against the
 * 4-row kernel): 6-row tiles ran at 85-90 GFLOP/s (0.85-0.91x the time at 12, 24, 30, 36, 64, 512 rows),
 * 4- and 5-row tiles at 75-77 (20 rows as 5 5 5 5: 0.97x), so as many rows as can go in 6-row tiles do. */
static int64_t plan_tiles(int64_t mc, int8_t *sizes) {
    int64_t n = 0;
    const int64_t full = mc / AMR, rem = mc % AMR;
    for (int64_t t = 0; t < full; t++) sizes[n++] = AMR;
    if (rem == 0) return n;
    if (rem >= 4 || full == 0) { sizes[n++] = (int8_t)rem; return n; }
    const int64_t tail = AMR + rem;                /* 7-9 rows in the last two tiles */
    sizes[n - 1] = (int8_t)((tail + 1) / 2), sizes[n++] = (int8_t)(tail / 2);
    return n;
}

/* One k chunk (pairs k0 .. k0 + kn) of one 16-output panel over the mc widened rows (xs: the pass's rows,
 * tile-interleaved by widen()); mr and pf compile-time per instance (a lone tile streams its own prefetch,
 * several share the next chunk's: chunk_ahead.h). */
TARGET static void chunk(const float *xs, int64_t k0, const int8_t *sizes, int64_t tiles, int64_t K, int64_t kn,
                         const uint16_t *ws, float *cb, int first, int last, uint16_t *y, int64_t ldy, int64_t nb,
                         int64_t n_valid, const Chunk *next) {
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int mr = sizes[t];
        if (tiles == 1) {
            switch (mr) {
                case 1: TILE(1, 1); break;
                case 2: TILE(2, 1); break;
                case 3: TILE(3, 1); break;
                case 4: TILE(4, 1); break;
                case 5: TILE(5, 1); break;
                default: TILE(AMR, 1);
            }
        } else {
            switch (mr) {
                case 3: TILE(3, 0); break;
                case 4: TILE(4, 0); break;
                case 5: TILE(5, 0); break;
                default: TILE(AMR, 0);
            }
        }
        m0 += mr;
    }
}

/* The mc rows of x (bf16, row stride ldx) widened to float32 (a 16-bit shift) into xf, tile by tile
 * (plan_tiles), each tile's rows interleaved by k pair: tile rows m0 .. m0 + mr - 1 take xf[m0 K ..
 * (m0 + mr) K) as xf[m0 K + (kk mr + i) 2 + e] = x[m0 + i, 2 kk + e], so that a k pair of the tile is one
 * contiguous run its broadcasts read at constant offsets (one pointer, not one per row). One row: x itself. */
TARGET static void widen(const uint16_t *x, int64_t ldx, const int8_t *sizes, int64_t tiles, int64_t K, float *xf) {
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int mr = sizes[t];
        float *dst = xf + m0 * K;
        for (int i = 0; i < mr; i++) {
            const uint16_t *xr = x + (m0 + i) * ldx;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {              /* 8 values = 4 pairs, each pair 8 bytes at stride 8 mr */
                const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xr + k))), 16));
                const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
                float *d = dst + (k / 2 * mr + i) * 2;
                _mm_storel_pi((__m64 *)d, lo);
                _mm_storeh_pi((__m64 *)(d + 2 * mr), lo);
                _mm_storel_pi((__m64 *)(d + 4 * mr), hi);
                _mm_storeh_pi((__m64 *)(d + 6 * mr), hi);
            }
            for (; k < K; k++) dst[(k / 2 * mr + i) * 2 + (k & 1)] = bf16_to_f32(xr[k]);
        }
        m0 += mr;
    }
}

/* y[m, n] (bf16, row stride ldy) = sum_k x[m, k] W[n, k] for m < M, n < n_valid; arguments as
 * pd_gemv_bf16 (x bf16 [M, K] with row stride ldx, K even; wp packed [Np/16][K/2][16][2]).
 * Returns 0, or -1 if the widened rows and partial sums could not be allocated. */
TARGET int pd_gemm_bf16_avx2(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                             const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y, int64_t ldy) {
    const int64_t K2 = K / 2;
    if (M <= 0) return 0;
    int64_t rows = X_BUDGET / (K > 0 ? K : 1);
    rows = rows < AMR ? AMR : rows > 256 ? 256 : rows;
    rows = rows < M ? rows : M;
    float *xf = aligned_alloc(64, ((size_t)(rows * K) * sizeof(float) + 63) / 64 * 64);
    float *cbuf = aligned_alloc(64, (size_t)((rows + AMR) * 16) * sizeof(float));
    if (!xf || !cbuf) { free(xf); free(cbuf); return -1; }
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mc = M - m0 < rows ? M - m0 : rows;
        int8_t sizes[MAX_TILES];
        const int64_t tiles = plan_tiles(mc, sizes);
        widen(x + m0 * ldx, ldx, sizes, tiles, K, xf);
        int64_t nb = 0;
        if (mc == 1)                                 /* one row: panels in pairs (row_two_panels) */
            for (; nb + 32 <= Np && nb < n_valid; nb += 32)
                for (int64_t k0 = 0; k0 < K2; k0 += AKC) {
                    const int64_t kn = K2 - k0 < AKC ? K2 - k0 : AKC;
                    row_two_panels(xf + 2 * k0, kn, wp + nb * K + k0 * 32, wp + (nb + 16) * K + k0 * 32, cbuf,
                                   k0 == 0, k0 + kn == K2, y + m0 * ldy, nb, n_valid);
                }
        for (; nb < Np && nb < n_valid; nb += 16)
            for (int64_t k0 = 0; k0 < K2; k0 += AKC) {
                const int64_t kn = K2 - k0 < AKC ? K2 - k0 : AKC;
                const Chunk next = chunk_after(wp, Np, n_valid, K, nb, 1, k0, kn, 1, AKC);
                chunk(xf, k0, sizes, tiles, K, kn, wp + nb * K + k0 * 32, cbuf, k0 == 0, k0 + kn == K2,
                      y + m0 * ldy, ldy, nb, n_valid, &next);
            }
    }
    free(xf);
    free(cbuf);
    return 0;
}
