/* bf16 matrix-vector products for decode on x86 CPUs with AVX512-BF16.
 *
 * Decode multiplies a few activation rows by every weight matrix, so it is bound by
 * the bytes of weight streamed from memory. Weights are pre-packed once into the
 * "VNNI" order the dot-product instruction consumes, so the kernel reads one
 * sequential stream and never reduces across a vector:
 *
 *   W [N, K] row-major   ->   Wp [N/16][K/2][16][2]     (N padded to 16, K to 2)
 *   Wp[nb][kk][j][e] = W[16 nb + j, 2 kk + e]
 *
 *   one 64-byte load = 16 output rows x 2 input columns;
 *   acc[j] += x[2kk] W[16nb+j, 2kk] + x[2kk+1] W[16nb+j, 2kk+1]   (vdpbf16ps, fp32 accumulate)
 *
 * Activation rows are taken four at a time, so a 16-row weight block (16 K bf16, at most
 * a few hundred KiB) is re-read from cache, not memory, for rows beyond the fourth.
 * Every output row sums in the same order whatever M is: results do not depend on
 * the batch. pd_gemm_bf16_avx512 (below) keeps that order for many rows, register-blocked;
 * pd_gemm_bf16_amx uses AMX tiles and its own order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_ahead.h"
#include "cpu_family.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

int pd_cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

int pd_cpu_supported(void) { return pd_cpu_has_avx512_bf16(); }   /* asked by kernels.cpu.available */

/* How the gemv streams its weights, per CPU (from pf_rows rows a software prefetch pf_lead elements ahead into
 * L1; `streams` 16-row blocks side by side):
 *
 * - AMD family 19h (Zen 4): one stream, prefetched 2,048 elements (4 KiB) ahead from 3 rows. With one row
 *   the hardware prefetcher keeps up and a software prefetch only slows the stream; with three or four the
 *   loop's arithmetic (a broadcast and a vdpbf16ps per row per 64 bytes) fills the out-of-order window and
 *   the stream stalls without one. bench-80m's 48 projections from DRAM, huge pages, interleaved A/B in one
 *   process (15 rounds, medians): 4 rows 6.68-6.85 -> 5.30-5.52 ms, 3 rows 5.53 -> 5.11, 2 rows 4.79 ->
 *   4.70, 1 row 4.62 -> 4.99 (so not there); 2 KiB or 8 KiB ahead: less gain.
 * - Intel: two streams, prefetched 1,024 elements (2 KiB) ahead at every row count. One stream, not
 *   prefetched, left an AMX Xeon (model 167 under KVM, 2026-11-28) at 57% of its read bandwidth, behind
 *   the register-blocked gemms' several streams; the same 48 projections, L3 evicted, bench/kernel_ab.py
 *   (7 rounds): 1 row 15.8 -> 10.8 ms, 2 rows 19.0 -> 11.7 (one prefetched stream 11.2-13.3 at leads of
 *   512-4,096 elements, T0 or T1; two without a prefetch 12.9; four 11.0).
 * - AMD family 1Ah (Zen 5): one stream, prefetched 2,048 elements (4 KiB) ahead from 1 row. Without it one
 *   row streamed at 83% of the read bandwidth (EPYC family 26 model 2 under KVM, 2026-11-28; the same
 *   projections, L3 evicted, kernel_ab, medians of 9-11 rounds, three runs): 1 row 0.95-0.965x, 2 rows
 *   0.88-0.89x of the time without; leads of 1,536 and 3,072 elements gained less at 1 row (0.97x), 4,096
 *   and more lost at 1 row, two streams lost 26% and, prefetched, 9-12%.
 * - elsewhere (older AMD): one stream, no prefetch, until measured. */
typedef struct { int pf_rows, pf_lead, streams; } GemvPlan;

static GemvPlan gemv_plan(void) {
    static GemvPlan plan;
    if (!plan.streams) {
        __builtin_cpu_init();
        plan = __builtin_cpu_is("amdfam19h") ? (GemvPlan){3, 2048, 1}
             : amd_family() == 0x1A ? (GemvPlan){1, 2048, 1}
             : __builtin_cpu_is("intel") ? (GemvPlan){1, 1024, 2} : (GemvPlan){1 << 30, 0, 1};
    }
    return plan;
}

/* Rows m0..m0+mm-1 (mm <= 4) of `nbl` (1 or 2) consecutive 16-row blocks from nb, their weight streams
 * side by side; pf: software prefetch lead (elements), 0 for none. Each output keeps its two chains. */
TARGET static inline __attribute__((always_inline)) void gemv_blocks(
        const int nbl, const int32_t *const xr[4], int64_t mm, int64_t K2, const uint16_t *wb, int64_t K,
        int pf, uint16_t *y, int64_t ldy, int64_t nb, int64_t n_valid) {
    __m512 a0[2][4], a1[2][4];                   /* two chains per row and block: even and odd kk */
    for (int b = 0; b < nbl; b++)
        for (int i = 0; i < 4; i++) { a0[b][i] = _mm512_setzero_ps(); a1[b][i] = _mm512_setzero_ps(); }
    int64_t kk = 0;
    for (; kk + 1 < K2; kk += 2) {
        for (int b = 0; b < nbl; b++) {
            const uint16_t *w = wb + b * 16 * K + kk * 32;
            if (pf) {
                _mm_prefetch((const char *)(w + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + 32 + pf), _MM_HINT_T0);
            }
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
            for (int i = 0; i < mm; i++) {
                a0[b][i] = _mm512_dpbf16_ps(a0[b][i], (__m512bh)_mm512_set1_epi32(xr[i][kk]), w0);
                a1[b][i] = _mm512_dpbf16_ps(a1[b][i], (__m512bh)_mm512_set1_epi32(xr[i][kk + 1]), w1);
            }
        }
    }
    if (kk < K2)
        for (int b = 0; b < nbl; b++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + b * 16 * K + kk * 32);
            for (int i = 0; i < mm; i++)
                a0[b][i] = _mm512_dpbf16_ps(a0[b][i], (__m512bh)_mm512_set1_epi32(xr[i][kk]), w0);
        }
    for (int b = 0; b < nbl; b++) {
        const int64_t cnt = n_valid - nb - 16 * b < 16 ? n_valid - nb - 16 * b : 16;
        const __mmask16 mask = (__mmask16)((1u << cnt) - 1);
        for (int i = 0; i < mm; i++) {
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(a0[b][i], a1[b][i]));
            _mm256_mask_storeu_epi16(y + i * ldy + nb + 16 * b, mask, (__m256i)o);
        }
    }
}

/* y[m, n] (bf16, row stride ldy) = sum_k x[m, k] W[n, k] for m < M, n < n_valid.
 * x: bf16 [M, K], row stride ldx (elements), K even. wp: packed [Np/16][K/2][16][2], Np % 16 == 0.
 * Returns 0 (the signature of pd_gemm_bf16_amx). */
TARGET int pd_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                        const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y, int64_t ldy) {
    const int64_t K2 = K / 2;
    const GemvPlan plan = gemv_plan();
    const int pf = M >= plan.pf_rows ? plan.pf_lead : 0;
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 16 * plan.streams) {   /* blocks holding wanted outputs */
        const int two = plan.streams == 2 && nb + 16 < Np && nb + 16 < n_valid;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mm = M - m0 < 4 ? M - m0 : 4;
            const int32_t *xr[4];
            for (int i = 0; i < 4; i++) xr[i] = (const int32_t *)(x + (m0 + (i < mm ? i : 0)) * ldx);
            if (two) gemv_blocks(2, xr, mm, K2, wp + nb * K, K, pf, y + m0 * ldy, ldy, nb, n_valid);
            else gemv_blocks(1, xr, mm, K2, wp + nb * K, K, pf, y + m0 * ldy, ldy, nb, n_valid);
        }
    }
    return 0;
}

/* ---- AVX512-BF16 GEMM: the gemv's arithmetic, register-blocked for 3..hundreds of rows ----------
 *
 * Every output keeps the gemv's two float32 chains (even kk, odd kk, each in ascending kk, added
 * and rounded once at the end), so a row's result is bit-identical to pd_gemv_bf16's whatever M is.
 * The loops put the weights outermost, so each packed byte comes from memory once per call:
 *
 *   for n0 in steps of GNR blocks (GNR*16 outputs):           weight panel [GNR][K/2][16][2]
 *     for k0 in steps of GKC pairs:                          its GNR*16*GKC*4 bytes (96 KiB) stay in L2
 *       for m0 in steps of GMR rows:                         GMR x GNR tile, 2 zmm chains each
 *         acc = k0 ? cbuf : 0;  acc += x[m0.., kk] (bf16 pair, broadcast) * Wp[n0.., kk]
 *         k0 last ? y = bf16(acc_even + acc_odd) : cbuf = acc      (float32 store/load: exact)
 *
 * 2*GMR*GNR accumulators + GNR weight vectors + 1 broadcast = 28 of the 32 zmm registers. A lone row
 * tile prefetches its weight streams a fixed distance ahead; with several, each prefetches a share of
 * the next chunk (chunk_ahead.h) while the chunk it computes stays in L2. GMR < M <= LMR rows run as
 * one lone tile over one block at a time instead (gemm_lone).
 */
#define GMR 4
#define GNR 3
#define GKC 512      /* kk pairs per k chunk (even: chains keep parity). 512 rather than 128 (24 KiB, in L1): a
                      * quarter of the float32 partial-sum round trips; with chunk_ahead.h, bench-80m's
                      * projections on Zen 4 (bench/cpu_kernels.py) reach 97% of their floor at 32 rows and
                      * 92% at 512 (74% and 89% before both) */
#define GPF 1024                                   /* elements of prefetch lead per weight stream */
/* lead_eighth: with 8 row tiles or more to a chunk (32 rows and up), each tile issues its share of the next
 * chunk's lines over the first eighth of its k steps rather than over all of them (half of them: two pairs
 * a step). bench-80m's 48 projections from DRAM at 32 rows, Zen 4, interleaved: 0.970x, 0.969x, 0.968x the
 * time in three runs (bench/kernel_ab.py --kernel gemm_bf16_avx512), the batch-32 decode step 0.952x and
 * 0.968x (bench/step_ab.py); 128 and 512 rows 1.00x / 0.99x. Spread over a quarter: 0.969x / 0.979x; the
 * next chunk but one in place of the next: 1.00x; the lines walked in the order the next chunk's first
 * tile reads them (all blocks' pair p before pair p + 1) in place of block by block: 1.12x at 8 rows, 1.01x
 * at 32; into the L3 (T2) in place of L2: 1.00x. Fewer tiles keep the spread: at 8 rows (two tiles) a
 * quarter's lead took 1.40x the time. On Zen 4 (AMD family 19h), where it was measured; elsewhere the spread
 * stays. */
static int lead_eighth(void) {
    static int on = -1;                                 /* read once: a benign race between threads */
    if (on < 0) { __builtin_cpu_init(); on = __builtin_cpu_is("amdfam19h"); }
    return on;
}
#define LMR 8        /* up to this many rows (more than GMR) take one lone tile over one block at a time, */
#define LMR_ZEN4 5   /* on Zen 4 up to this many (lone_rows) */
#define LPF 4096     /* its prefetch lead (elements, 8 KiB): 2 KiB covered too little of the memory latency at
                      * the rate 8 rows compute (bench-80m's 48 projections at 8 rows, Zen 5: 5.1-5.5 ms with
                      * 2 KiB, 4.0-4.5 with 8 KiB, 4.2-4.3 with 16 KiB, 6.5-6.6 with none) */

TARGET static inline __attribute__((always_inline)) void gemm_tile(
        const int mr, const int nr, const int pf, const uint16_t *x, int64_t ldx, int64_t k0, int64_t kn,
        const uint16_t *wb, int64_t K, float *cb, int first, int last, uint16_t *y, int64_t ldy,
        int64_t nb, int64_t n_valid, Ahead ahead) {          /* pf: in-stream prefetch lead (elements), 0: none */
    __m512 a0[LMR][GNR], a1[LMR][GNR], w[GNR];
    const int32_t *xr[LMR];
    for (int i = 0; i < mr; i++) xr[i] = (const int32_t *)(x + i * ldx) + k0;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            a0[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cb + (i * GNR + j) * 32);
            a1[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cb + (i * GNR + j) * 32 + 16);
        }
    const uint16_t *ws = wb + k0 * 32;              /* block j of the panel at ws + j * 16 * K */
    int64_t kk = 0;
    for (; kk + 1 < kn; kk += 2) {
        if (pf)
            for (int j = 0; j < nr; j++) {
                _mm_prefetch((const char *)(ws + j * 16 * K + kk * 32 + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(ws + j * 16 * K + kk * 32 + pf + 32), _MM_HINT_T0);
            }
        ahead_step(&ahead);
        for (int j = 0; j < nr; j++) w[j] = _mm512_loadu_ps(ws + j * 16 * K + kk * 32);
        for (int i = 0; i < mr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[i][kk]);
            for (int j = 0; j < nr; j++) a0[i][j] = _mm512_dpbf16_ps(a0[i][j], xb, (__m512bh)w[j]);
        }
        for (int j = 0; j < nr; j++) w[j] = _mm512_loadu_ps(ws + j * 16 * K + kk * 32 + 32);
        for (int i = 0; i < mr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[i][kk + 1]);
            for (int j = 0; j < nr; j++) a1[i][j] = _mm512_dpbf16_ps(a1[i][j], xb, (__m512bh)w[j]);
        }
    }
    if (kk < kn) {
        for (int j = 0; j < nr; j++) w[j] = _mm512_loadu_ps(ws + j * 16 * K + kk * 32);
        for (int i = 0; i < mr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[i][kk]);
            for (int j = 0; j < nr; j++) a0[i][j] = _mm512_dpbf16_ps(a0[i][j], xb, (__m512bh)w[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            if (!last) {
                _mm512_storeu_ps(cb + (i * GNR + j) * 32, a0[i][j]);
                _mm512_storeu_ps(cb + (i * GNR + j) * 32 + 16, a1[i][j]);
                continue;
            }
            const int64_t n = nb + 16 * j, cnt = n_valid - n < 16 ? n_valid - n : 16;
            if (cnt <= 0) continue;
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(a0[i][j], a1[i][j]));
            _mm256_mask_storeu_epi16(y + i * ldy + n, (__mmask16)((1u << cnt) - 1), (__m256i)o);
        }
}

/* One k chunk of one weight panel over all M rows; mr, nr, pf compile-time in each instance. */
#define GEMM_TILE(MR, NR, PF) gemm_tile(MR, NR, PF, x + m0 * ldx, ldx, k0, kn, wb, K, cb, first, last, \
                                        y + m0 * ldy, ldy, nb, n_valid, ahead)
TARGET static void gemm_chunk(const int nr, const uint16_t *x, int64_t M, int64_t ldx, int64_t k0, int64_t kn,
                              const uint16_t *wb, int64_t K, float *cbuf, int first, int last,
                              uint16_t *y, int64_t ldy, int64_t nb, int64_t n_valid, const Chunk *next) {
    const int64_t tiles = (M + GMR - 1) / GMR;
    const int pf = tiles == 1 ? GPF : 0;      /* in-stream prefetch for a lone tile only: a remainder tile
                                               * reads the chunk the first tile brought into L2, and its
                                               * prefetcht0 stream only held L1 miss buffers (bench-80m's
                                               * projections, Zen 4, interleaved A/B: 6 rows 6.06 -> 5.80 ms,
                                               * 9 rows 8.26 -> 7.63, 7 and 33 rows unchanged) */
    for (int64_t m0 = 0; m0 < M; m0 += GMR) {
        const int mr = M - m0 < GMR ? (int)(M - m0) : GMR;
        const Ahead ahead = ahead_share(next, m0 / GMR, tiles, tiles >= 8 && lead_eighth() ? kn / 8 : kn / 2);
        float *cb = cbuf + m0 * GNR * 32;
        if (nr == GNR && mr == GMR) {
            if (tiles == 1) GEMM_TILE(GMR, GNR, GPF); else GEMM_TILE(GMR, GNR, 0);
        } else if (nr == GNR) {                /* a remainder tile: the chunk is in L2 after the first tile */
            switch (mr) { case 1: GEMM_TILE(1, GNR, pf); break; case 2: GEMM_TILE(2, GNR, pf); break;
                          default: GEMM_TILE(3, GNR, pf); }
        } else if (nr == 2) {
            switch (mr) { case 1: GEMM_TILE(1, 2, pf); break; case 2: GEMM_TILE(2, 2, pf); break;
                          case 3: GEMM_TILE(3, 2, pf); break; default: GEMM_TILE(GMR, 2, pf); }
        } else {
            switch (mr) { case 1: GEMM_TILE(1, 1, pf); break; case 2: GEMM_TILE(2, 1, pf); break;
                          case 3: GEMM_TILE(3, 1, pf); break; default: GEMM_TILE(GMR, 1, pf); }
        }
    }
}

/* GMR < M <= LMR rows as one tile over one 16-output block at a time (2 M accumulators, the same two
 * chains per output as every tile: bit-identical to the gemv), the weights streamed once, LPF ahead.
 * As two GMR-row tiles over 3-block panels, 5-8 rows had streamed their weights at ~30 GB/s of a
 * core's 42 on Zen 5, and at ~34 GB/s even from L3. bench-80m's 48 projections from DRAM, Zen 5,
 * interleaved runs of bench/cpu_kernels.py's linears: 8 rows 4.9-5.2 -> 4.0-4.5 ms, 5 rows 4.9-5.4 ->
 * 3.9-4.1 ms (bandwidth floor 3.6); warm, N=4096 K=768 at 8 rows 186 -> 123 us.
 * Zen 4 (the AVX-512 CPUs of AMD family 19h) runs each 512-bit operation as two 256-bit halves, and
 * the lone tile's one broadcast per vdpbf16ps then costs it compute: the same 48 projections, an
 * interleaved A/B in one process (9 rounds, medians), lone tile against two 4-row tiles: 5 rows
 * 5.83 vs 6.26 ms, 6 rows 6.24 vs 6.14, 7 rows 6.81 vs 6.54, 8 rows 7.82 vs 6.32. So there it takes
 * 5 rows only (lone_rows). */
TARGET static void gemm_lone(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t Np,
                             int64_t n_valid, uint16_t *y, int64_t ldy, float *cb) {
    const int64_t K2 = K / 2;
    const Ahead ahead = {NULL, 0, 0, 0};
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 16) {
        const uint16_t *wb = wp + nb * K;
        for (int64_t k0 = 0; k0 < K2; k0 += GKC) {
            const int64_t kn = K2 - k0 < GKC ? K2 - k0 : GKC;
            const int first = k0 == 0, last = k0 + kn == K2;
            const int64_t m0 = 0;
            switch (M) { case 5: GEMM_TILE(5, 1, LPF); break; case 6: GEMM_TILE(6, 1, LPF); break;
                         case 7: GEMM_TILE(7, 1, LPF); break; default: GEMM_TILE(LMR, 1, LPF); }
        }
    }
}

/* The most rows gemm_lone takes on this CPU: LMR_ZEN4 on AMD family 19h (Zen 4; Zen 3, the other
 * 19h CPUs, has no AVX-512 and never runs this file's kernels), LMR elsewhere. */
static int lone_rows(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("amdfam19h") ? LMR_ZEN4 : LMR;
}

/* As pd_gemv_bf16 (same arguments, same packed layout, bit-identical results), for any M. Rows are
 * taken GMC at a time (the weights are re-read per GMC rows: negligible traffic at that intensity), so
 * the x chunk and the partial sums of one pass stay in L2 whatever M is.
 * Returns 0, or -1 if the float32 partial sums (GMC x 384 bytes, when K > 2 * GKC) cannot be allocated. */
#define GMC 256
TARGET int pd_gemm_bf16_avx512(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                               const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y, int64_t ldy) {
    const int64_t K2 = K / 2;
    float *cbuf = NULL;
    if (K2 > GKC && !(cbuf = aligned_alloc(64, (size_t)(GMC * GNR * 32) * sizeof(float)))) return -1;
    if (M > GMR && M <= lone_rows()) {
        gemm_lone(x, M, K, ldx, wp, Np, n_valid, y, ldy, cbuf);
        free(cbuf);
        return 0;
    }
    for (int64_t m0 = 0; m0 < M; m0 += GMC) {
        const int64_t mc = M - m0 < GMC ? M - m0 : GMC;
        for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 16 * GNR) {
            const int64_t left = (Np - nb) / 16, nr = left < GNR ? left : GNR;
            const uint16_t *wb = wp + nb * K;
            for (int64_t k0 = 0; k0 < K2; k0 += GKC) {
                const int64_t kn = K2 - k0 < GKC ? K2 - k0 : GKC;
                const Chunk next = chunk_after(wp, Np, n_valid, K, nb, nr, k0, kn, GNR, GKC);
                gemm_chunk((int)nr, x + m0 * ldx, mc, ldx, k0, kn, wb, K, cbuf, k0 == 0, k0 + kn == K2,
                           y + m0 * ldy, ldy, nb, n_valid, &next);
            }
        }
    }
    free(cbuf);
    return 0;
}

#include "gemm_amx.h"   /* pd_cpu_has_amx_bf16, pd_gemm_bf16_amx */
