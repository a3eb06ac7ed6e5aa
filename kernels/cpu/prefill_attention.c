/* Causal attention of prefill chunks over the paged bf16 KV cache, on AVX512-BF16 or float32 FMAs.
 *
 * torch's CPU flash attention runs at 40-75 GFLOP/s on one core for a 512- or 2,048-token
 * bf16 prompt (bench-80m shapes, Zen 5 and Emerald Rapids), a tenth of the same core's GEMM
 * rate, so at 2,048 tokens attention was half of a prefill. This kernel follows the online-
 * softmax formulation of FlashAttention (Dao et al., 2022; Milakov & Gimelshein, 2018): per
 * query tile, key tiles of 32 are scored, the running max and sum are rescaled, and the
 * output accumulates without the score matrix ever being stored:
 *
 *   for each sequence b, KV head g:
 *     K -> Kp [L/32][D/2][32][2] bf16   (pairs of dims, 32 keys per two zmm: vdpbf16ps B operand)
 *     V -> Vp [L/2][D][2] bf16          (pairs of keys: the B operand of the value sums)
 *     for each tile of query rows (tokens x the heads of g):
 *       for each key tile at or before the tile's last position:
 *         S = scale * q Kp^T              vdpbf16ps, float32 sums of exact bf16 products
 *         S[key > position] = -inf        (causal: query token i sits at position L - nq + i)
 *         m' = max(m, max S); a = exp(m - m'); P = exp(S - m'); l = a l + sum P; O = a O + bf16(P) V
 *         (m' = m, a = 1, unless max S passes m by SLACK: O / l is the same up to rounding whatever the
 *         reference max, so a row is rescaled only when its max grows by e^SLACK, as FlashAttention-4
 *         rescales conditionally; P stays below e^SLACK. 2,048 tokens: 53.9 -> 48.6 ms a layer on Zen 4)
 *       out = O / l, rounded to bf16
 *   (l kept as a vector per row and reduced once at the end, as the AMX build keeps it: 0.96x the time on Zen 4;
 *   a degree-3 2^x, 0.97x more, flipped a near-tied greedy token of a decode row that a mixed colocated step
 *   sends through this kernel (tests/test_multi_step.py), and was not kept)
 *
 * Scores, the softmax and its sum are float32; P is rounded to bf16 for the value sums (as
 * FlashAttention rounds P to the input type) in the vdpbf16ps build and kept in float32 in the FMA
 * build; the value sums are float32 sums of exact products either way.
 * Layout of the cache as paged_attention.c reads it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NK 32                     /* keys per tile: two zmm of scores per row */
#define SLACK 8.f                 /* a row's reference max moves only when a score passes it by this: P <= e^8 */
#define RMAX 12                   /* query rows per tile: 24 score accumulators */
#define MAX_D 256
#include "prefill_attention.h"
#include "prefill_softmax.h"

/* vdpbf16ps where the build targets a CPU that has it (-march=native there), else the same products
 * on float32 FMAs: bf16 pairs widened by a shift (even element) and a mask (odd element), exact, and
 * P kept in float32 (the dot-product build rounds it to bf16, as FlashAttention rounds P to the input
 * type for its matrix units; FMAs need no rounding). -DPD_NO_DPBF16 forces the FMA form (how the tests reach it on a
 * CPU with AVX512-BF16). */
#if defined(__AVX512BF16__) && !defined(PD_NO_DPBF16)
#define PD_DPBF16 1
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
typedef uint16_t pval;                                  /* P as the value sums take it: bf16 pairs */
#else
#define PD_DPBF16 0
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
typedef float pval;                                     /* P as float32 (not rounded: FMAs need no bf16) */
#endif
#define INLINE static inline __attribute__((always_inline))

int pd_cpu_supported(void) {                             /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && (!PD_DPBF16 || __builtin_cpu_supports("avx512bf16"));
}


/* O[r] = alpha[r] O[r] + sum_j P[r][j] V[j] for RG rows at once (alpha O skipped when every alpha is 1),
 * their O rows in registers while each pair of V rows is loaded once (NVC zmm per pair; compile-time in
 * each instance); keys past a row's last one have P = 0. AVX512-BF16: P taken two keys at a time by vdpbf16ps. FMA build: each
 * V pair widened once into its two keys' rows, P broadcast as float32 (two FMAs per pair and row). */
TARGET INLINE void pv_rows(const int NVC, const int RG, float *const *O, const float *alpha, const pval (*P)[NK],
                           const uint16_t *vt, int64_t D, int keys) {
    __m512 o[6][16];
    int rescale = 0;                              /* a row's max moved: almost only in the first key tiles */
    for (int r = 0; r < RG; r++) rescale |= alpha[r] != 1.f;
    for (int r = 0; r < RG; r++)
        for (int v = 0; v < NVC; v++) o[r][v] = _mm512_loadu_ps(O[r] + 16 * v);
    if (rescale)
        for (int r = 0; r < RG; r++)
            for (int v = 0; v < NVC; v++) o[r][v] = _mm512_mul_ps(o[r][v], _mm512_set1_ps(alpha[r]));
    for (int j = 0; j < keys; j += 2) {
#if PD_DPBF16
        __m512bh pj[6];
        for (int r = 0; r < RG; r++) {
            int32_t pair;
            memcpy(&pair, P[r] + j, 4);
            pj[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int v = 0; v < NVC; v++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j * D + 32 * v);
            for (int r = 0; r < RG; r++) o[r][v] = _mm512_dpbf16_ps(o[r][v], pj[r], vv);
        }
#else
        for (int v = 0; v < NVC; v++) {
            const __m512i w = _mm512_loadu_si512(vt + j * D + 32 * v);
            const __m512 ve = bf16_even_f32(w), vo = bf16_odd_f32(w);
            for (int r = 0; r < RG; r++)
                o[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(P[r][j]), ve, _mm512_fmadd_ps(_mm512_set1_ps(P[r][j + 1]), vo, o[r][v]));
        }
#endif
    }
    for (int r = 0; r < RG; r++)
        for (int v = 0; v < NVC; v++) _mm512_storeu_ps(O[r] + 16 * v, o[r][v]);
}

/* PV of R rows in register groups: 6 rows for D = 64 (24 accumulators), 3 for D = 128, else one
 * row at a time through pv_rows' one-row instances of 16 lanes (any D a multiple of 16). */
TARGET static void pv(int R, float *const *O, const float *alpha, const pval (*P)[NK], const uint16_t *vt,
                      int64_t D, int keys) {
    for (int r0 = 0; r0 < R;) {
        const int left = R - r0;
        if (D == 64 && left >= 6) { pv_rows(4, 6, O + r0, alpha + r0, P + r0, vt, D, keys); r0 += 6; }
        else if (D == 64) { pv_rows(4, 1, O + r0, alpha + r0, P + r0, vt, D, keys); r0 += 1; }
        else if (D == 128 && left >= 3) { pv_rows(8, 3, O + r0, alpha + r0, P + r0, vt, D, keys); r0 += 3; }
        else if (D == 128) { pv_rows(8, 1, O + r0, alpha + r0, P + r0, vt, D, keys); r0 += 1; }
        else {                                                 /* other head sizes: 16 dims at a time */
            for (int64_t d = 0; d < D; d += 16) {
                float *Od = O[r0] + d;
                pv_rows(1, 1, &Od, alpha + r0, P + r0, vt + 2 * d, D, keys);
            }
            r0 += 1;
        }
    }
}

/* The queries of a tile as the score products take them, at a fixed stride so that one register addresses
 * every row: bf16 pairs (vdpbf16ps build) or float32 (FMA build). */
#if PD_DPBF16
typedef uint16_t qval;
#else
typedef float qval;
#endif

/* S[r] = q[r] . K over one key tile of NK keys (two zmm a row), for R rows: with R a constant the 2R
 * accumulators stay in registers for the whole dot product (with R a variable GCC kept them in memory, a
 * load and a store around every two products: 1.3x slower on Zen 4). NH = 1: keys 0-15 only (S[r][1] = 0),
 * for a tile whose rows see none of keys 16-31. */
TARGET INLINE void qk_rows(const int R, const int NH, const qval (*q)[MAX_D], const uint16_t *kt, int64_t NP,
                           __m512 (*S)[2]) {
    __m512 a[RMAX][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < NP; p++) {
#if PD_DPBF16
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * NK * 2);
        const __m512bh k1 = NH > 1 ? (__m512bh)_mm512_loadu_si512(kt + p * NK * 2 + 32) : k0;
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, q[r] + 2 * p, 4);
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
            if (NH > 1) a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
        }
#else
        const __m512i k0 = _mm512_loadu_si512(kt + p * NK * 2);
        const __m512i k1 = NH > 1 ? _mm512_loadu_si512(kt + p * NK * 2 + 32) : k0;
        const __m512 k0e = bf16_even_f32(k0), k0o = bf16_odd_f32(k0), k1e = bf16_even_f32(k1), k1o = bf16_odd_f32(k1);
        for (int r = 0; r < R; r++) {
            const __m512 qe = _mm512_set1_ps(q[r][2 * p]), qo = _mm512_set1_ps(q[r][2 * p + 1]);
            a[r][0] = _mm512_fmadd_ps(qe, k0e, _mm512_fmadd_ps(qo, k0o, a[r][0]));
            if (NH > 1) a[r][1] = _mm512_fmadd_ps(qe, k1e, _mm512_fmadd_ps(qo, k1o, a[r][1]));
        }
#endif
    }
    for (int r = 0; r < R; r++) S[r][0] = a[r][0], S[r][1] = a[r][1];
}

/* qk_rows with R a constant for full tiles (RMAX rows: every group size that divides 12), else a variable;
 * half (every row sees at most keys 0-15 of the tile, its causal diagonal) the first 16 keys only: the
 * others' scores are masked whatever they are, so the result is the same. */
TARGET static void qk(int R, int half, const qval (*q)[MAX_D], const uint16_t *kt, int64_t NP, __m512 (*S)[2]) {
    if (R == RMAX && half) qk_rows(RMAX, 1, q, kt, NP, S);
    else if (R == RMAX) qk_rows(RMAX, 2, q, kt, NP, S);
    else qk_rows(R, 2, q, kt, NP, S);
}

/* One query tile of R rows (their bf16 query vectors qr[r], positions pos[r]) against keys
 * [0, max pos], writing out rows or[r]. */
TARGET static int tile(int R, const uint16_t *const *qr, const int64_t *pos, uint16_t *const *orow,
                       const uint16_t *kp, const uint16_t *vp, int64_t D, float scale) {
    float Obuf[RMAX][MAX_D] __attribute__((aligned(64))), l[RMAX], alpha[RMAX];
    SoftRow rows[RMAX];                                  /* each row's running sum, reduced once at the end */
    pval P[RMAX][NK] __attribute__((aligned(64)));
    qval q[RMAX][MAX_D] __attribute__((aligned(64)));    /* the queries, copied (FMA build: widened) once */
    for (int r = 0; r < R; r++)
#if PD_DPBF16
        memcpy(q[r], qr[r], sizeof(uint16_t) * (size_t)D);
#else
        for (int64_t d = 0; d < D; d++) q[r][d] = bf16_to_f32(qr[r][d]);
#endif
    float *O[RMAX];
    int64_t last = 0;
    for (int r = 0; r < R; r++) {
        O[r] = Obuf[r];
        soft_row_init(&rows[r]);
        memset(O[r], 0, sizeof(float) * (size_t)D);
        last = pos[r] > last ? pos[r] : last;
    }
    const __m512 sc = _mm512_set1_ps(scale * LOG2E);            /* the softmax walks in base 2 */
    const Pow2K k = pow2_consts();
    for (int64_t t = 0; t * NK <= last; t++) {
        __m512 acc[RMAX][2];
        qk(R, last < t * NK + NK / 2, (const qval (*)[MAX_D])q, kp + t * NK * D, D / 2, acc);
        int keys = 0;                                        /* the widest row's visible keys */
        for (int r = 0; r < R; r++) {
            const int64_t n = tile_keys(pos[r], t, &alpha[r], P[r], sizeof P[r]);
            if (n <= 0) continue;
            keys = n > keys ? (n < NK ? (int)n : NK) : keys;
            __m512 p0, p1;
            softmax_tile(acc[r][0], acc[r][1], n, sc, scale * LOG2E, &rows[r], &alpha[r], &p0, &p1, &k);
#if PD_DPBF16
            _mm512_store_si512(P[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));    /* keys 0..15, 16..31 */
#else                          /* float32: nothing to round for (7% faster than rounding to bf16 first) */
            _mm512_store_ps(P[r], p0);
            _mm512_store_ps(P[r] + 16, p1);
#endif    /* keys 0..15, 16..31 */
        }
        pv(R, O, alpha, (const pval (*)[NK])P, vp + t * NK * D, D, keys);
    }
    for (int r = 0; r < R; r++) l[r] = _mm512_reduce_add_ps(rows[r].lv);
    write_rows(R, O, l, orow, D);
    return 0;
}

PD_PREFILL_ENTRY(tile)
