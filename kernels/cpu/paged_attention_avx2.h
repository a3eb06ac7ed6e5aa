/* paged_attention.c's path for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 / Zen 3, Intel client
 * cores), bf16 caches, head sizes a multiple of 16 up to 256. Sixteen ymm registers hold neither a
 * group's queries nor its output rows, so this path keeps PagedAttention v1's exact two-pass softmax
 * (Kwon et al., SOSP 2023) per group of up to RA (row, head) pairs of one KV head, on 8-lane FMAs:
 *
 *   rows[t]     the context's K row addresses, walked page by page once (no division per token)
 *   scores      per token, each pair's <q, K_t> as 8-lane partial sums (even and odd dims of each
 *               16-dim block: 2 chains a pair), reduced 8 tokens at a time by a transpose-and-add
 *               tree; the next chunk's K rows are prefetched into L1
 *   softmax     s = scale * score, masked past each pair's causal limit; p = exp(s - max) (exp8,
 *               exp16.h), l = sum p
 *   values      per 16-dim block, each V row widened once (even and odd dims) for every pair of the
 *               group: o += p_t V_t (2 chains a pair), out = o / l back in dim order
 *
 * Float32 throughout; a pair's result depends only on its own query, sequence and limit (the same
 * instructions whichever pairs share its group): batch-invariant. Included by paged_attention.c only,
 * after paged_attention_portable.h (Ctx).
 */
#ifndef PD_PAGED_ATTENTION_AVX2_H
#define PD_PAGED_ATTENTION_AVX2_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exp16.h"
#include "paged_attention_portable.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE AVX2 static inline __attribute__((always_inline))
#define RA 6                                    /* pairs per group: 12 accumulators */
#define AVX2_MAX_D 256

/* Lane k of the result = the sum of the 8 lanes of a[k]. */
AVX2_INLINE __m256 hsum8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The cache the walk reads next, a sequence ahead: while sequence b's (kv head, group) walks compute, the
 * pages of sequence b + 1 are prefetched whole, in order (each page's K part, all kv heads' rows, then its V
 * part), PF_LINES cache lines for each K or V row the arithmetic reads. Its first kv head then finds every
 * row in L2 and the reads run as contiguous 8 KiB runs, not as a kv head's 128-byte rows strided across
 * them. pf == NULL: no prefetch (a walk's later passes, whose rows the first brought in). */
#ifndef PF_LINES
#define PF_LINES 2
#endif
typedef struct {
    const Ctx *c; const int32_t *seq_lens, *tables; int64_t max_blocks, B, b, page, part_bytes, off;
} Ahead;

/* Whether sequence b's pages come in through the stream: every sequence but the batch's first whose pages
 * (one layer's) take at most PF_SEQ_BYTES, so that with the sequence being computed they stay in L2. The others
 * are prefetched a (kv head, group) walk ahead, row by row (row_table). */
#ifndef PF_SEQ_BYTES
#define PF_SEQ_BYTES (192 << 10)
#endif
static inline int streamed(const Ahead *a, int64_t b) {
    const int64_t bs = a->c->block_size;
    return b > 0 && b < a->B && (a->seq_lens[b] + bs - 1) / bs * 2 * a->part_bytes <= PF_SEQ_BYTES;
}

/* Moves the stream to sequence b's pages (none past the batch's last). */
static inline void ahead_to(Ahead *a, int64_t b) { a->b = b, a->page = 0, a->off = 0; }

AVX2_INLINE void prefetch_ahead(Ahead *a) {
    if (!a || a->b >= a->B) return;
    const Ctx *c = a->c;
    const int64_t npages = (a->seq_lens[a->b] + c->block_size - 1) / c->block_size;
    for (int l = 0; l < PF_LINES; l++) {
        if (a->off == 2 * a->part_bytes) {
            a->off = 0;
            if (++a->page == npages) { a->b = a->B; return; }
        }
        const char *page = (const char *)c->cache + (int64_t)a->tables[a->b * a->max_blocks + a->page] * c->s_block * 2;
        const int64_t o = a->off < a->part_bytes ? a->off : c->s_v * 2 + a->off - a->part_bytes;
        _mm_prefetch(page + o, _MM_HINT_T1);
        a->off += 64;
    }
}
/* The 8-lane partial dot products of R pairs with the K row k (even dims: ae[r], odd: ao[r]). */
AVX2_INLINE void dots1(const int R, const uint16_t *k, int64_t NB, const float *qe, const float *qo, __m256 *ae,
                       __m256 *ao) {
    for (int r = 0; r < R; r++) ae[r] = ao[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < NB; j++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(k + 16 * j));
        const __m256 ke = bf16_even8(w), ko = bf16_odd8(w);
        for (int r = 0; r < R; r++) {
            ae[r] = _mm256_fmadd_ps(ke, _mm256_loadu_ps(qe + r * AVX2_MAX_D / 2 + 8 * j), ae[r]);
            ao[r] = _mm256_fmadd_ps(ko, _mm256_loadu_ps(qo + r * AVX2_MAX_D / 2 + 8 * j), ao[r]);
        }
    }
}

/* Scores of the R pairs (queries qe / qo: even / odd dims, D / 2 floats each) against tokens t0 .. t0 + nt,
 * nt <= 8, into sc[r][t0 .. t0 + 8) (scaled; 0 past nt); the next chunk's K rows are prefetched into L1 and
 * the stream (pf) advanced a K row's lines per token. */
AVX2_INLINE void scores8(const int R, const uint16_t *const *rows, int64_t t0, int nt, int64_t NB,
                         const float *qe, const float *qo, float *sc, int64_t ld, __m256 vscale, Ahead *pf,
                         int64_t n) {
    __m256 part[RA][8];
    int tt = 0;
    for (; tt < nt; tt++) {
        for (int64_t b = 0; b < NB * 32 && t0 + tt + 8 < n; b += 64)      /* the next chunk's K rows into L1 */
            _mm_prefetch((const char *)rows[t0 + tt + 8] + b, _MM_HINT_T0);
        prefetch_ahead(pf);
        __m256 ae[RA], ao[RA];
        dots1(R, rows[t0 + tt], NB, qe, qo, ae, ao);
        for (int r = 0; r < R; r++) part[r][tt] = _mm256_add_ps(ae[r], ao[r]);
    }
    for (; tt < 8; tt++)
        for (int r = 0; r < R; r++) part[r][tt] = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) _mm256_storeu_ps(sc + r * ld + t0, _mm256_mul_ps(hsum8(part[r]), vscale));
}

/* o[r] (dims 16 j .. 16 (j + BJ), dim order) = sum_t p[r][t] V_t over tokens 0 .. n, times inv[r]; BJ
 * (compile-time) blocks of 16 dims a pass: two where the group is small enough (R <= 3: 12
 * accumulators), so each V row pointer and each broadcast p serves 32 dims. The first pass prefetches the
 * V rows PF_V tokens ahead into L1 (pfv: bytes of a row) and drives the stream (pf). */
#define PF_V 16
AVX2_INLINE void values16(const int R, const int BJ, const uint16_t *const *rows, int64_t n, int64_t j,
                          int64_t s_v, const float *p, int64_t ld, const float *inv, float *const *orow,
                          Ahead *pf, int64_t pfv) {
    __m256 oe[RA][2], oo[RA][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < BJ; h++) oe[r][h] = oo[r][h] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        if (pfv && t + PF_V < n)                                   /* V rows into L1, PF_V tokens ahead */
            for (int64_t b = 0; b < pfv; b += 64) _mm_prefetch((const char *)(rows[t + PF_V] + s_v) + b, _MM_HINT_T0);
        prefetch_ahead(pf);
        const uint16_t *v = rows[t] + s_v + 16 * j;
        __m256 pr[RA];
        for (int r = 0; r < R; r++) pr[r] = _mm256_broadcast_ss(p + r * ld + t);
        for (int h = 0; h < BJ; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 16 * h));
            const __m256 ve = bf16_even8(w), vo = bf16_odd8(w);
            for (int r = 0; r < R; r++) {
                oe[r][h] = _mm256_fmadd_ps(pr[r], ve, oe[r][h]);
                oo[r][h] = _mm256_fmadd_ps(pr[r], vo, oo[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++)                           /* (even, odd) dims -> dim order */
        for (int h = 0; h < BJ; h++) {
            const __m256 a = _mm256_mul_ps(oe[r][h], _mm256_set1_ps(inv[r]));
            const __m256 b = _mm256_mul_ps(oo[r][h], _mm256_set1_ps(inv[r]));
            const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
            _mm256_storeu_ps(orow[r] + 16 * (j + h), _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_storeu_ps(orow[r] + 16 * (j + h) + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
}

/* Every pair's output, values16 pass by pass; the first drives the prefetch stream (pf). */
AVX2_INLINE void values_group(const int R, const uint16_t *const *rows, int64_t n, int64_t NB, int64_t s_v,
                              const float *p, int64_t ld, const float *inv, float *const *orow, Ahead *pf) {
    int64_t j = 0;
#define V16(BJ_) values16(R, BJ_, rows, n, j, s_v, p, ld, inv, orow, pf, !j ? NB * 32 : 0)
    if (R <= 3)
        for (; j + 2 <= NB; j += 2, pf = NULL) V16(2);
    for (; j < NB; j++, pf = NULL) V16(1);
#undef V16
}

/* Softmax of row sc[0 .. n) in place (the row has room for n rounded up to 8), entries past lim (causal)
 * and the padding first set to -inf. Returns 1 / sum. */
AVX2 static float softmax8(float *sc, int64_t n, int64_t lim) {
    const int64_t npad = (n + 7) / 8 * 8;
    for (int64_t t = lim + 1; t < npad; t++) sc[t] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < npad; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
    const __m256 m = _mm256_set1_ps(hmax8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < npad; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
        _mm256_storeu_ps(sc + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    return 1.f / hadd8(sum);
}

/* One group of R (compile-time) pairs over tokens 0 .. n (n = the largest limit + 1). */
AVX2_INLINE void group_avx2(const int R, const Ctx *c, const uint16_t *const *rows, int64_t n, const float **qrow,
                            float **orow, const int64_t *lim, float scale, float *sc, int64_t ld, Ahead *pf) {
    float qe[RA * AVX2_MAX_D / 2] __attribute__((aligned(32))), qo[RA * AVX2_MAX_D / 2] __attribute__((aligned(32)));
    float inv[RA];
    const int64_t D = c->D, NB = D / 16;
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < D / 2; i++) {
            qe[r * AVX2_MAX_D / 2 + i] = qrow[r][2 * i];
            qo[r * AVX2_MAX_D / 2 + i] = qrow[r][2 * i + 1];
        }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t t0 = 0; t0 < n; t0 += 8)
        scores8(R, rows, t0, (int)(n - t0 < 8 ? n - t0 : 8), NB, qe, qo, sc, ld, vscale, pf, n);
    for (int r = 0; r < R; r++) inv[r] = softmax8(sc + r * ld, n, lim[r]);
    values_group(R, rows, n, NB, c->s_v, sc, ld, inv, orow, pf);
}

/* The K row address of every token 0 .. n of kv head kvh of the sequence with block table `table`, page by
 * page; with pf, each K and V row is prefetched into L2 on the way (the walks the sequence stream of Ahead
 * does not cover). batch_avx2 builds the next (sequence, kv head)'s table before computing this one, so its
 * rows arrive while this one computes. */
AVX2 static void row_table(const Ctx *c, const int32_t *table, int64_t kvh, int64_t n, const uint16_t **rows,
                           int pf) {
    const uint16_t *base = (const uint16_t *)c->cache;
    for (int64_t t = 0, p = 0; t < n; p++) {
        const uint16_t *page = base + (int64_t)table[p] * c->s_block + kvh * c->s_head;
        for (int64_t o = 0; o < c->block_size && t < n; o++, t++) {
            rows[t] = page + o * c->s_tok;
            for (int64_t b = 0; pf && b < c->D * 2; b += 64) {
                _mm_prefetch((const char *)rows[t] + b, _MM_HINT_T1);
                _mm_prefetch((const char *)(rows[t] + c->s_v) + b, _MM_HINT_T1);
            }
        }
    }
}

/* Pairs (rows R of one kv head, limits lim) through the compile-time group sizes. */
AVX2 static void rows_avx2(const Ctx *c, int R, const uint16_t *const *rows, const float **qrow, float **orow,
                           const int64_t *lim, float scale, float *sc, int64_t ld, Ahead *pf) {
    int64_t n = 0;
    for (int r = 0; r < R; r++) n = lim[r] + 1 > n ? lim[r] + 1 : n;
    switch (R) {
    case 1: group_avx2(1, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    case 2: group_avx2(2, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    case 3: group_avx2(3, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    case 4: group_avx2(4, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    case 5: group_avx2(5, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    default: group_avx2(6, c, rows, n, qrow, orow, lim, scale, sc, ld, pf); break;
    }
}

/* Every sequence's pairs, a (sequence, kv head) at a time, R_max = RA pairs a group; rows: room for two
 * tables of max_len rows (this (sequence, kv head)'s and the next one's), sc: RA x ld score rows. The first
 * group of pairs of each (sequence, kv head) advances the sequence stream (Ahead); sequences it does not
 * cover come in row by row, a (sequence, kv head) ahead (row_table). bench/kernel_ab.py against the row
 * prefetch alone, Zen 3 (2026-12-02), cold / warm: 32 x 141 0.78 / 0.81, 32 x 1,025 1.05 / 0.97, 4 x 513
 * 1.04 / 1.06, 1 x 141 1.04 / 0.99 (the last three take no stream: noise); bit-identical. */
AVX2 static void batch_avx2(Ctx *c, const float *q, float *out, int64_t H, int64_t Hkv, const int32_t *qs,
                            const int32_t *seq_lens, int64_t B, const int32_t *tables, int64_t max_blocks,
                            float scale, float *sc, int64_t ld, const uint16_t **rows, int64_t max_len) {
    const int64_t G = H / Hkv, D = c->D, groups = B * Hkv;
    const float *qrow[RA]; float *orow[RA]; int64_t lim[RA];
    Ahead ahead = {c, seq_lens, tables, max_blocks, B, B, 0, c->s_v * 2, 0};
    if (groups) row_table(c, tables, 0, seq_lens[0], rows, 1);
    for (int64_t k = 0; k < groups; k++) {
        const int64_t b = k / Hkv, kvh = k % Hkv, nb = (k + 1) / Hkv;
        const int64_t q0 = qs[b], nq = qs[b + 1] - qs[b], first = seq_lens[b] - nq;
        const uint16_t *const *cur = rows + (k & 1) * max_len;
        if (kvh == 0) ahead_to(&ahead, streamed(&ahead, b + 1) ? b + 1 : B);
        if (k + 1 < groups)
            row_table(c, tables + nb * max_blocks, (k + 1) % Hkv, seq_lens[nb],
                      rows + ((k + 1) & 1) * max_len, !streamed(&ahead, nb));
        for (int64_t p0 = 0; p0 < nq * G; p0 += RA) {          /* pairs (row i, head g), RA at a time */
            const int R = (int)(nq * G - p0 < RA ? nq * G - p0 : RA);
            group_pairs(p0, R, G, H, D, kvh, q0, first, q, out, qrow, orow, lim);
            rows_avx2(c, R, cur, qrow, orow, lim, scale, sc, ld, p0 == 0 ? &ahead : NULL);
        }
    }
}

static inline int avx2_takes(const Ctx *c) {
    return c->bf16 && c->D % 16 == 0 && c->D <= AVX2_MAX_D && __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma");
}

#endif
