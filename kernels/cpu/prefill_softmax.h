/* The online-softmax step of one query row over one 32-key tile, shared by the AVX-512 prefill attention
 * kernels (prefill_attention.c, prefill_attention_amx.c; FlashAttention's, Dao et al., 2022): mask keys
 * past the row's n visible ones (n >= 1), move the reference max only when a score passes it by SLACK
 * (then alpha = exp(m - m'), else 1), and return P = exp(scale S - m) for keys 0-15 and 16-31 (the max
 * taken over the raw scores and scaled once; scale S - m one fused multiply-subtract).
 *
 * The walk runs in base 2, as FlashAttention-2's kernels do: the caller passes scale * log2(e), the row's
 * reference max m is kept in those units, and P = 2^(S' - m) (pow2_16). The including file defines NK (32)
 * and SLACK (natural units). Since 2026-11-28 (exp16 before): one layer's attention on AMX tiles 0.92x /
 * 0.86x at 512 / 2,048 tokens, the AVX512-BF16 and FMA builds 0.96-1.01x (bench/kernel_ab.py, Xeon 167). */
#ifndef PD_PREFILL_SOFTMAX_H
#define PD_PREFILL_SOFTMAX_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LOG2E 1.44269504088896341f

/* 2^x on 16 lanes for x <= ~64: n = round(x) (adding and subtracting 1.5 x 2^23: two single-uop adds
 * where vrndscaleps is two uops on port 0 of Intel cores), 2^(x - n) by a degree-3 polynomial (relative
 * error 1.0e-4 over [-1/2, 1/2] in float32, a twentieth of the 2^-9 to which P is rounded for the value
 * sums; minimax of the relative error with p(0) = 1, fitted for this kernel by reweighted least
 * squares), times 2^n by vscalefps (exact); 0 where `keep` is clear (masked keys). Results below 2^-126
 * would be subnormals, a microcode assist on Intel cores (exp16.h): the kernels' entry (PD_FTZ_SCOPE,
 * prefill_attention.h) runs them with MXCSR's flush-to-zero and denormals-are-zero set, so they are 0,
 * as the compare with -125 that this function made until 2026-11-29 made them (one uop in nine of
 * each exponential's). The softmax's vector work is what bounds the AMX build. Since 2026-11-29 (degree 5, vrndscaleps,
 * and the scores scaled before the max rather than fused into the subtraction): one layer's attention on
 * AMX tiles 0.93x / 0.92x at 512 / 2,048 tokens, then 0.96-1.03x / 0.91-0.96x for the rounding by adds
 * (bit-identical), the AVX512-BF16 build 0.99x (bench/kernel_ab.py, Xeon 207). */
typedef struct { __m512 magic, c3, c2, c1, one; } Pow2K;     /* pow2_16's constants */

/* The constants as values the compiler may rematerialize: it broadcasts each from memory at every use. */
__attribute__((target("avx512f"), always_inline)) static inline Pow2K pow2_consts(void) {
    return (Pow2K){_mm512_set1_ps(12582912.f),            /* 1.5 x 2^23: x + magic rounds x to an integer */
                   _mm512_set1_ps(5.500858e-02f), _mm512_set1_ps(2.4221037e-01f), _mm512_set1_ps(6.932829e-01f),
                   _mm512_set1_ps(1.f)};
}

/* The same held in registers across the caller's loop (an empty asm makes them opaque, so they are not
 * broadcast again at every use): the AMX build, whose softmax loads share the core with its tile loads (one
 * layer of bench-80m 0.953x / 0.951x the time at 512 tokens in two runs, 0.99x / 1.00x at 2,048; AMX Xeon 167,
 * bench/kernel_ab.py). The AVX-512 build keeps pow2_consts: its score accumulators need the registers. */
__attribute__((target("avx512f"), always_inline)) static inline Pow2K pow2_pinned(void) {
    Pow2K k = pow2_consts();
    __asm__("" : "+v"(k.magic), "+v"(k.c3), "+v"(k.c2), "+v"(k.c1), "+v"(k.one));
    return k;
}

__attribute__((target("avx512f"), always_inline)) static inline __m512 pow2_16(__m512 x, __mmask16 keep,
                                                                               const Pow2K *k) {
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, k->magic), k->magic);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = k->c3;
    p = _mm512_fmadd_ps(p, f, k->c2);
    p = _mm512_fmadd_ps(p, f, k->c1);
    p = _mm512_fmadd_ps(p, f, k->one);
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* Keys of key tile t that a query row at position pos may see; where none (<= 0), the row is unchanged:
 * its alpha is 1 and its P row (`bytes` at p) zero. */
static inline int64_t tile_keys(int64_t pos, int64_t t, float *alpha, void *p, size_t bytes) {
    const int64_t n = pos - t * NK + 1;
    if (n <= 0) {
        *alpha = 1.f;
        memset(p, 0, bytes);
    }
    return n;
}

/* One row's state across key tiles: the per-lane running sums lv, the reference max m (base-2 units) and
 * on every lane of mv (read as a memory operand: no broadcast uop a tile), the raw score past which m
 * moves (thr = (m + SLACK log2 e) / scale2: the test takes no multiply). */
typedef struct { __m512 lv, mv; float m, thr; } SoftRow;

static inline void soft_row_init(SoftRow *row) {
    row->lv = _mm512_setzero_ps();
    row->m = row->thr = -INFINITY;
    row->mv = _mm512_set1_ps(-INFINITY);
}

/* The step over raw scores a0 (keys 0-15), a1 (16-31) of which n >= 1 are visible; scale2 = scale x
 * log2 e on every lane, s2 the same as a float (> 0). Writes the row's alpha and P, adds P to row->lv
 * (rescaled first when alpha is not 1). Returns whether the row's reference max moved (else alpha is 1). */
__attribute__((target("avx512f"), always_inline)) static inline int softmax_tile(
        __m512 a0, __m512 a1, int64_t n, __m512 scale2, float s2, SoftRow *row, float *alpha, __m512 *p0,
        __m512 *p1, const Pow2K *k) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __mmask32 vis = n >= NK ? 0xffffffffu : (__mmask32)((1u << n) - 1);
    const __m512 rmax = _mm512_max_ps(_mm512_mask_mov_ps(ninf, (__mmask16)vis, a0),
                                      _mm512_mask_mov_ps(ninf, (__mmask16)(vis >> 16), a1));
    *alpha = 1.f;
    const int moved = _mm512_cmp_ps_mask(rmax, _mm512_set1_ps(row->thr), _CMP_GT_OQ) != 0;
    if (moved) {                                                               /* always on the first tile, */
        /* where alpha is 0 (2^-inf would be NaN here: no floor compare) */
        const float mt = _mm512_reduce_max_ps(rmax) * s2;                     /* = the max of the scaled */
        *alpha = row->m == -INFINITY ? 0.f : _mm512_cvtss_f32(pow2_16(_mm512_set1_ps(row->m - mt), 0xffff, k));
        row->lv = _mm512_mul_ps(row->lv, _mm512_set1_ps(*alpha));
        row->m = mt;
        row->mv = _mm512_set1_ps(mt);
        row->thr = (mt + SLACK * LOG2E) / s2;
    }
    *p0 = pow2_16(_mm512_fmsub_ps(a0, scale2, row->mv), (__mmask16)vis, k);
    *p1 = pow2_16(_mm512_fmsub_ps(a1, scale2, row->mv), (__mmask16)(vis >> 16), k);
    row->lv = _mm512_add_ps(row->lv, _mm512_add_ps(*p0, *p1));
    return moved;
}
#endif
