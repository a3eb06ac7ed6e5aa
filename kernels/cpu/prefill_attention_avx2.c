/* Causal attention of prefill chunks over the paged bf16 KV cache on AVX2 float32 FMAs, for x86 CPUs
 * without AVX-512 (AMD Zen 2 / Zen 3, Intel client cores): prefill_attention.c's FMA build on 8-lane
 * vectors. Same algorithm (FlashAttention's online softmax, Dao et al., 2022; the conditional rescale
 * past SLACK), same operand layouts (prefill_attention.h), with the register budget of sixteen ymm:
 *
 *   key tiles of NK = 16 keys: two ymm of scores per query row
 *   scores:     up to 4 rows at a time: 8 accumulators, the key pair row widened to 4 ymm, 2 broadcasts
 *               acc[r] = fma(q[r][2p], K_even, fma(q[r][2p + 1], K_odd, acc[r]))     (p: dim pairs)
 *   value sums: one 8-dim block of up to 8 rows at a time: 8 accumulators, each V pair row (two keys)
 *               loaded and widened once for all of them; P broadcast as float32 (not rounded)
 *
 * Scores, softmax, sums and P are float32; the value sums are float32 sums of exact products; out =
 * O / l rounded to bf16 (nearest even). A score is the same float as the AVX-512 FMA build's (the same
 * chain per key); softmax sums and reference maxima follow 16-key tiles rather than 32, so outputs
 * agree with that build to float32 rounding, not bit for bit.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp16.h"

#define NK 16                     /* keys per tile: two ymm of scores per row */
#define SLACK 8.f                 /* a row's reference max moves only when a score passes it by this */
#define RMAX 12                   /* query rows per tile */
#define RQ 4                      /* rows whose scores are accumulated at once */
#define RV 6                      /* rows whose value sums are accumulated at once (12 chains) */
#define MAX_D 256
#include "prefill_attention.h"

#define TARGET __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

int pd_cpu_supported(void) {                             /* asked by kernels.cpu.available */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* S[r][k] = q[r] . K[k] for the n (compile-time) rows qf[0 .. n) and the NK keys of tile kt. */
TARGET INLINE void scores(const int n, float (*S)[NK], float (*qf)[MAX_D], const uint16_t *kt, int64_t NP) {
    __m256 acc[RQ][2];
    for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < NP; p++) {
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)(kt + p * NK * 2));
        const __m256i k1 = _mm256_loadu_si256((const __m256i *)(kt + p * NK * 2 + 16));
        const __m256 k0e = bf16_even8(k0), k0o = bf16_odd8(k0), k1e = bf16_even8(k1), k1o = bf16_odd8(k1);
        for (int r = 0; r < n; r++) {
            const __m256 qe = _mm256_broadcast_ss(&qf[r][2 * p]), qo = _mm256_broadcast_ss(&qf[r][2 * p + 1]);
            acc[r][0] = _mm256_fmadd_ps(qe, k0e, _mm256_fmadd_ps(qo, k0o, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(qe, k1e, _mm256_fmadd_ps(qo, k1o, acc[r][1]));
        }
    }
    for (int r = 0; r < n; r++) {
        _mm256_storeu_ps(S[r], acc[r][0]);
        _mm256_storeu_ps(S[r] + 8, acc[r][1]);
    }
}

/* O[r][d .. d + 8) = alpha[r] O[r][d .. d + 8) + sum_j P[r][j] V[j][d .. d + 8) for n (compile-time) rows,
 * over the first `keys` keys of the tile (rounded up to a pair; P is 0 past a row's last key). Even and
 * odd keys accumulate apart (two chains a row, added at the end): one chain of two FMAs per pair left
 * the FMA latency, not the ports, in charge below 8 rows. */
TARGET INLINE void values(const int n, float *const *O, const float *alpha, float (*P)[NK],
                          const uint16_t *vt, int64_t D, int64_t d, int keys) {
    __m256 oe[RV], oo[RV];
    for (int r = 0; r < n; r++) {
        oe[r] = _mm256_mul_ps(_mm256_loadu_ps(O[r] + d), _mm256_set1_ps(alpha[r]));
        oo[r] = _mm256_setzero_ps();
    }
    for (int j = 0; j < keys; j += 2) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(vt + j * D + 2 * d));
        const __m256 ve = bf16_even8(w), vo = bf16_odd8(w);
        for (int r = 0; r < n; r++) {
            oe[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&P[r][j]), ve, oe[r]);
            oo[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&P[r][j + 1]), vo, oo[r]);
        }
    }
    for (int r = 0; r < n; r++) _mm256_storeu_ps(O[r] + d, _mm256_add_ps(oe[r], oo[r]));
}

#define CASE_S(k) case k: scores(k, S + r0, qf + r0, kt, NP); break;
#define CASE_V(k) case k: values(k, O + r0, alpha + r0, P + r0, vt, D, d, keys); break;

/* Query rows' running max m, sum l and output O over one more key tile of visible keys: row r sees
 * keys t NK .. pos[r]. Returns the widest row's visible keys in the tile (0: no row sees any). */
TARGET static int softmax_tile(int R, const int64_t *pos, int64_t t, float scale, float (*S)[NK], float (*P)[NK],
                               float *m, float *l, float *alpha) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    int keys = 0;
    for (int r = 0; r < R; r++) {
        const int64_t n = pos[r] - t * NK + 1;           /* keys of this tile the row may see */
        if (n <= 0) {
            alpha[r] = 1.f;
            memset(P[r], 0, sizeof P[r]);
            continue;
        }
        keys = n > keys ? (n < NK ? (int)n : NK) : keys;
        const __m256i nv = _mm256_set1_epi32(n < NK ? (int)n : NK);
        const __m256 vis0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, lane));
        const __m256 vis1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(lane, eight)));
        const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(S[r]), sc), vis0);
        const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(S[r] + 8), sc), vis1);
        const __m256 smax = _mm256_max_ps(s0, s1);
        float mt = m[r];
        alpha[r] = 1.f;
        if (_mm256_movemask_ps(_mm256_cmp_ps(smax, _mm256_set1_ps(m[r] + SLACK), _CMP_GT_OQ))) {
            mt = hmax8(smax);
            alpha[r] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - mt)));   /* 0 on the row's first tile */
        }
        const __m256 mv = _mm256_set1_ps(mt);
        const __m256 p0 = exp8(_mm256_sub_ps(s0, mv)), p1 = exp8(_mm256_sub_ps(s1, mv));
        l[r] = l[r] * alpha[r] + hadd8(_mm256_add_ps(p0, p1));
        m[r] = mt;
        _mm256_storeu_ps(P[r], p0);
        _mm256_storeu_ps(P[r] + 8, p1);
    }
    return keys;
}

/* One query tile (prefill_attention.h's tile_fn). */
TARGET static int tile(int R, const uint16_t *const *qr, const int64_t *pos, uint16_t *const *orow,
                       const uint16_t *kp, const uint16_t *vp, int64_t D, float scale) {
    float Obuf[RMAX][MAX_D] __attribute__((aligned(32))), qf[RMAX][MAX_D] __attribute__((aligned(32)));
    float S[RMAX][NK] __attribute__((aligned(32))), P[RMAX][NK] __attribute__((aligned(32)));
    float m[RMAX], l[RMAX], alpha[RMAX], *O[RMAX];
    int64_t last = 0;
    for (int r = 0; r < R; r++) {
        for (int64_t d = 0; d < D; d++) qf[r][d] = bf16_to_f32(qr[r][d]);   /* widened once: broadcast operands */
        O[r] = Obuf[r];
        m[r] = -INFINITY; l[r] = 0.f;
        memset(O[r], 0, sizeof(float) * (size_t)D);
        last = pos[r] > last ? pos[r] : last;
    }
    const int64_t NP = D / 2;
    for (int64_t t = 0; t * NK <= last; t++) {
        const uint16_t *kt = kp + t * NK * D, *vt = vp + t * NK * D;
        for (int r0 = 0; r0 < R; r0 += RQ) {
            switch (R - r0 < RQ ? R - r0 : RQ) { CASE_S(1) CASE_S(2) CASE_S(3) CASE_S(4) }
        }
        const int keys = softmax_tile(R, pos, t, scale, S, P, m, l, alpha);
        for (int r0 = 0; r0 < R; r0 += RV)
            for (int64_t d = 0; d < D; d += 8) {
                switch (R - r0 < RV ? R - r0 : RV) {
                    CASE_V(1) CASE_V(2) CASE_V(3) CASE_V(4) CASE_V(5) CASE_V(6)
                }
            }
    }
    write_rows(R, O, l, orow, D);
    return 0;
}

PD_PREFILL_ENTRY(tile)
