/* SiLU-and-mul for fused.c (pd_silu_mul_to): out = silu(gate) * up over rows of gate_up [n, 2 inter] (gate
 * first, row stride ld) into out [n, inter] (row stride ldo) (SwiGLU, Shazeer 2020). Included by fused.c
 * after its load16 / store16 / rnd16 / tail16 (and PD_VECTOR_NORM); kernels/cpu/__init__.py keys its build
 * cache on headers too.
 *
 * silu(g) = g / (1 + e^-g) in float32, rounded to the element type, times up (torch's F.silu(gate) * up).
 * On AVX-512 16 lanes at a time with exp16.h's exp (Cephes' polynomial, within ~1 ulp, as torch's Sleef
 * and glibc's are: a result lying within a few float32 ulps of a bf16 rounding midpoint can round the
 * other way than torch's, one bf16 ulp). -g is capped at 100, past exp16's range (e^-g is inf from
 * -g > 88.72, as expf's, so silu is -0 there, as torch's); for g > 87 e^-g is 0 and silu g, as torch's.
 * Elsewhere through a buffer, so the expf loop vectorizes (glibc libmvec).
 *
 * bf16 gates have 65,536 values, so silu(g) rounded to bf16 is a function of g's 16 bits: the lookup path
 * reads it from a table that the arithmetic itself filled (every bit pattern once, at first use), one
 * gather of 16 lanes in place of the exponential and the division, and the product with up rounds as
 * before: bit-identical to the arithmetic by construction (tests/test_fused_prefill.py checks all 65,536).
 * Which path runs is chosen once per process by timing both on the same rows (silu_choose): the
 * gather's speed differs between cores. AMX Xeon model 167: 64 rows of 2,048 in L2, a scratch loop, 0.44 ns an
 * element by the arithmetic and 0.27 by the lookup; inside bench-80m's 512-token prefill the SiLU 7.1-7.7 ms by the
 * one and 4.9-5.2 by the other (bench/kernel_ab.py --kernel silu_mul, whose rows come from beyond the L2: 0.80x).
 */
#ifndef PD_SILU_MUL_H
#define PD_SILU_MUL_H
#include <pthread.h>
#include <time.h>

#ifdef PD_VECTOR_NORM
/* 16 lanes of silu(g) * u as the element type holds them (the comment above). */
static inline __attribute__((always_inline)) __m512 silu_mul16(__m512 g, __m512 u, const int bf16) {
    const __m512 e = exp16(_mm512_min_ps(_mm512_xor_ps(g, _mm512_set1_ps(-0.f)), _mm512_set1_ps(100.f)));  /* e^-g */
    return _mm512_mul_ps(rnd16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), bf16), u);
}

/* silu(g) rounded to bf16, by g's bits; two entries of padding: a gather reads 32 bits at entry g. */
static uint16_t silu_bf16[65536 + 2] __attribute__((aligned(64)));

/* 16 bf16 gates (bits) -> their silu from the table, widened to float32. */
static inline __attribute__((always_inline)) __m512 silu_lookup16(__m256i g) {
    const __m512i pair = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(g), (const void *)silu_bf16, 2);
    return _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
}

/* 16 lanes (mask m) of row i's silu(gate) * up at column d, stored; `lookup` (bf16 only): silu from the table. */
static inline __attribute__((always_inline)) void silu_mul_vec(const void *gate_up, int64_t inter, int64_t ld, void *out,
                                                               int64_t ldo, int64_t i, int64_t d, __mmask16 m,
                                                               const int bf16, const int lookup) {
    const __m512 u = load16(gate_up, i * ld + inter + d, bf16, m);
    const __m512 v = lookup ? _mm512_mul_ps(silu_lookup16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)gate_up + i * ld + d)), u)
                            : silu_mul16(load16(gate_up, i * ld + d, bf16, m), u, bf16);
    store16(out, i * ldo + d, v, bf16, m);
}

/* The rows with the element type and path constants: whole vectors unmasked, a row's tail masked. */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, int64_t n, int64_t inter,
                                                                int64_t ld, void *out, int64_t ldo, const int bf16,
                                                                const int lookup) {
    for (int64_t i = 0; i < n; i++) {
        int64_t d = 0;
        for (; d + 16 <= inter; d += 16) silu_mul_vec(gate_up, inter, ld, out, ldo, i, d, 0xffff, bf16, lookup);
        if (d < inter) silu_mul_vec(gate_up, inter, ld, out, ldo, i, d, tail16(inter, d), bf16, lookup);
    }
}

static void silu_rows_arith(const void *gu, int64_t n, int64_t inter, int64_t ld, void *out, int64_t ldo) {
    silu_mul_rows(gu, n, inter, ld, out, ldo, 1, 0);
}
static void silu_rows_lookup(const void *gu, int64_t n, int64_t inter, int64_t ld, void *out, int64_t ldo) {
    silu_mul_rows(gu, n, inter, ld, out, ldo, 1, 1);
}

static int silu_lookup_on;                      /* set once by silu_choose */
static pthread_once_t silu_once = PTHREAD_ONCE_INIT;

static double silu_seconds(void (*rows)(const void *, int64_t, int64_t, int64_t, void *, int64_t),
                           const uint16_t *gu, uint16_t *out, int64_t n, int64_t inter) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    rows(gu, n, inter, 2 * inter, out, inter);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
}

/* Fill the table from the arithmetic (silu times 1, rounded to bf16), then time both paths on 64 rows of
 * 512 gates spread as a layer's activations are (about N(0, 2.6), a fixed sequence) and keep the faster:
 * the least of seven alternating runs each. */
static void silu_choose(void) {
    for (int32_t g = 0; g < 65536; g += 16) {
        const __m512 bits = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_add_epi32(_mm512_set1_epi32(g), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                     14, 15)), 16));
        store16(silu_bf16, g, silu_mul16(bits, _mm512_set1_ps(1.f), 1), 1, 0xffff);
    }
    enum { N = 64, I = 512 };
    static uint16_t gu[N * 2 * I] __attribute__((aligned(64))), out[N * I] __attribute__((aligned(64)));
    uint32_t state = 12345u;
    for (int64_t j = 0; j < N * 2 * I; j++) {   /* the sum of four uniforms: roughly normal */
        float f = -2.f;
        for (int k = 0; k < 4; k++) { state = state * 1664525u + 1013904223u; f += (float)(state >> 8) * 0x1p-24f; }
        gu[j] = f32_to_bf16(f * 4.5f);
    }
    double arith = 1e9, lookup = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        const double a = silu_seconds(silu_rows_arith, gu, out, N, I), b = silu_seconds(silu_rows_lookup, gu, out, N, I);
        arith = a < arith ? a : arith;
        lookup = b < lookup ? b : lookup;
    }
    silu_lookup_on = lookup < arith;
}
#endif

/* Whether bf16 rows take the lookup (chosen at the first call of this or pd_silu_mul_to); 0 off AVX-512. */
int pd_silu_lookup(void) {
#ifdef PD_VECTOR_NORM
    pthread_once(&silu_once, silu_choose);
    return silu_lookup_on;
#else
    return 0;
#endif
}

/* Sets the path bf16 rows take from now on (1: the lookup), after the choice: for tests and benchmarks. */
void pd_silu_use_lookup(int on) {
#ifdef PD_VECTOR_NORM
    pthread_once(&silu_once, silu_choose);
    silu_lookup_on = on != 0;
#else
    (void)on;
#endif
}

void pd_silu_mul_to(const void *gate_up, int64_t n, int64_t inter, int64_t ld, void *out, int64_t ldo,
                    int bf16) {
#ifdef PD_VECTOR_NORM
    if (!bf16) silu_mul_rows(gate_up, n, inter, ld, out, ldo, 0, 0);
    else if (pd_silu_lookup()) silu_rows_lookup(gate_up, n, inter, ld, out, ldo);
    else silu_rows_arith(gate_up, n, inter, ld, out, ldo);
#else
    float buf[256];
    for (int64_t i = 0; i < n; i++)
        for (int64_t d0 = 0; d0 < inter; d0 += 256) {
            const int64_t m = inter - d0 < 256 ? inter - d0 : 256;
            for (int64_t d = 0; d < m; d++) buf[d] = get(gate_up, i * ld + d0 + d, bf16);
#pragma omp simd
            for (int64_t d = 0; d < m; d++) buf[d] = buf[d] / (1.f + expf(-buf[d]));
            for (int64_t d = 0; d < m; d++)
                put(out, i * ldo + d0 + d, rnd(buf[d], bf16) * get(gate_up, i * ld + inter + d0 + d, bf16), bf16);
        }
#endif
}

#endif
