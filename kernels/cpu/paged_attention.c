/* Paged attention for decode and short query blocks on CPUs: each sequence's context is
 * read straight from the block-major cache through its block table, once per KV head.
 *
 * Cache (one layer selected by the caller's base pointer):
 *   kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
 *   K of (block, offset, kv head) at base + block*s_block + offset*s_tok + head*s_head
 *   V of the same at that address + s_v
 *
 * Sequence b owns query rows [qs[b], qs[b+1]) of the flat batch, the last q_len tokens of
 * its seq_lens[b] context; row i may attend to positions <= seq_lens[b] - q_len + i
 * (causal inside the query block). Grouped-query: kv head h serves query heads
 * h*G .. h*G+G-1, G = num_heads / num_kv_heads. The (query row, head) pairs of one kv head
 * are taken R at a time (all G heads of a decode row together), so each K and V row is
 * loaded and converted to float32 once for R pairs.
 *
 * AVX-512 path (head_dim % 16 == 0, head_dim <= 256): the context is walked a page at a
 * time, in chunks of up to 16 tokens of one page. Per chunk and pair the 16 scores
 * s = scale * <q, K_t> come out of one transpose-and-add tree as one vector, then one
 * online-softmax update (running max m, running sum l; m moves, and the accumulator is
 * rescaled, only when a score passes m by e^SLACK, as FlashAttention-4 rescales, so the
 * update is a compare in the common case; exponentials inline, exp16.h) and the chunk's V
 * rows are added with weights exp(s - m); out = acc / l at the end. This is the split-free
 * form of flash-decoding (Dao et al. 2023) / the per-block softmax of vLLM's paged attention.
 * On Zen 4 each group of pairs of heads of up to 64 dims walks all its pages with its state in registers
 * (head-major), elsewhere the groups take one page at a time (page-major). The cache is read ahead of the
 * arithmetic: a page further on in the walk (through the block table, into the next kv head or sequence) is
 * prefetched into L2 a row at a time while this page is computed. See sequence_avx512.
 * AVX2 path (CPUs without AVX-512, bf16 caches; paged_attention_avx2.h): the two-pass softmax below
 * on 8-lane FMAs, groups of up to 6 pairs; a short sequence's pages prefetched whole into L2 while the
 * one before it computes, a long one's rows a (sequence, kv head) ahead. Portable path (other shapes and
 * CPUs): exact two-pass softmax per sequence as PagedAttention v1 (Kwon et al., SOSP 2023).
 *
 * Float32 arithmetic throughout whatever the cache dtype (bf16 rows are widened exactly; a
 * vdpbf16ps variant on the rows as they lie ran 5% slower on an Emerald Rapids core, and QK on
 * vdpbf16ps no faster on Zen 5: the kernel is not bound by its multiplies). Every pair's result
 * depends only on its own query, sequence and causal limit, computed by the same instruction
 * sequence whichever other pairs share its group: batch-invariant.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_family.h"
#include "exp16.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define MAX_VECS 16                          /* zmm registers of queries (and of accumulators) */

#include "paged_attention_portable.h"

#define MAX_R 8                                         /* pairs per group */
#define SLACK 8.f          /* a pair's reference max moves only when a score passes it by this: p <= e^8 */

#include "paged_attention_rows.h"
#include "paged_attention_avx2.h"

/* Group state: R pairs of NV vectors each; queries, accumulators and running sums in registers. */
typedef struct { __m512 qv[MAX_VECS], acc[MAX_VECS], lv[MAX_R]; float m[MAX_R]; } State;

/* Chunk of n <= 16 tokens t0.. of one page, K rows from element offset off; pf (or NULL): the K row of
 * the same token and kv head in the page computed next, prefetched into L2 with its V row as each of
 * this chunk's rows is read. Inlined with constant R, NV, full. */
AVX512 static inline __attribute__((always_inline)) void chunk_avx512(
        const Ctx *c, State *st, int64_t off, int n, int64_t t0, const int64_t *lim,
        __m512 vscale, const char *pf, const int R, const int NV, const int full) {
    if (full) n = 16;
    const int64_t esz = c->bf16 ? 2 : 4, rowb = NV * 16 * esz;
    __m512 part[MAX_R][16], kv[MAX_VECS];
    float pb[MAX_R][16] __attribute__((aligned(64)));
    for (int tt = 0; tt < n; tt++) {                    /* scores: R x n unreduced products */
        if (pf) prefetch_row_l2(pf + tt * c->s_tok * esz, rowb);
        load_row_vecs(c, off + tt * c->s_tok, kv, NV);
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_mul_ps(st->qv[r * NV], kv[0]);
            for (int j = 1; j < NV; j++) s = _mm512_fmadd_ps(st->qv[r * NV + j], kv[j], s);
            part[r][tt] = s;
        }
    }
    if (!full)
        for (int tt = n; tt < 16; tt++)
            for (int r = 0; r < R; r++) part[r][tt] = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {                       /* one online-softmax update per pair */
        int64_t count = lim[r] - t0 + 1;
        count = count < n ? count : n;
        if (count <= 0) { _mm512_store_ps(pb[r], _mm512_setzero_ps()); continue; }
        const __mmask16 mask = (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1);
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask,
                                            _mm512_mul_ps(vscale, hsum16(part[r])));
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(st->m[r] + SLACK), _CMP_GT_OQ)) {   /* always on the first chunk */
            const float cm = _mm512_reduce_max_ps(s);   /* rescale what was summed under the old max */
            const __m512 alpha = exp16(_mm512_set1_ps(st->m[r] - cm));               /* 0 on the first chunk */
            for (int j = 0; j < NV; j++) st->acc[r * NV + j] = _mm512_mul_ps(st->acc[r * NV + j], alpha);
            st->lv[r] = _mm512_mul_ps(st->lv[r], alpha);
            st->m[r] = cm;
        }
        const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(st->m[r])));      /* masked keys: 0 */
        st->lv[r] = _mm512_add_ps(st->lv[r], e);
        _mm512_store_ps(pb[r], e);
    }
    for (int tt = 0; tt < n; tt++) {                    /* acc += p V over the chunk */
        if (pf) prefetch_row_l2(pf + (tt * c->s_tok + c->s_v) * esz, rowb);
        load_row_vecs(c, off + c->s_v + tt * c->s_tok, kv, NV);
        for (int r = 0; r < R; r++) {
            const __m512 p = _mm512_set1_ps(pb[r][tt]);
            for (int j = 0; j < NV; j++) st->acc[r * NV + j] = _mm512_fmadd_ps(p, kv[j], st->acc[r * NV + j]);
        }
    }
}

/* A group's R pairs (queries qrow[r], outputs orow[r], causal limits lim[r] >= 0) of kv head kvh and
 * their online-softmax state between pages. */
typedef struct {
    __m512 acc[MAX_VECS], lv[MAX_R]; float m[MAX_R];
    const float *qrow[MAX_R]; float *orow[MAX_R]; int64_t lim[MAX_R], lmax, kvh; int R;
} Group;

/* Where a sequence's walk sits in the batch's (for the prefetches that run on into the next kv head's and the next
 * sequence's pages): sequences [0, B), their lengths and block tables, kv heads per sequence. */
typedef struct { const int32_t *seq_lens, *tables; int64_t max_blocks, B, Hkv, b; int head_major; } Walk;

#ifndef PF_AHEAD
#define PF_AHEAD 2                                      /* pages of lead of the L2 prefetch in a group's walk */
#endif

/* Token 0 of the rows of the page `ahead` pages past page p of (sequence w->b, kv head kvh), with that page's
 * kv head: in a head-major walk's order (a kv head's pages, then the next kv head's, then the next
 * sequence's), else in a page-major one's, where a kv head's pages run on into the next sequence's; NULL past
 * the batch's last. */
static inline const char *rows_ahead(const Ctx *c, const Walk *w, int64_t kvh, int64_t p, int64_t ahead) {
    const int64_t esz = c->bf16 ? 2 : 4, bs = c->block_size;
    for (int64_t b = w->b, left = p + ahead; b < w->B;) {
        const int64_t npages = (w->seq_lens[b] + bs - 1) / bs;
        if (left < npages)
            return (const char *)c->cache + ((int64_t)w->tables[b * w->max_blocks + left] * c->s_block + kvh * c->s_head) * esz;
        left -= npages;
        if (!w->head_major) b++;
        else if (++kvh == w->Hkv) kvh = 0, b++;
    }
    return NULL;
}

/* Pages [p0, p1) of group g (p1 < 0: to its last, the page of token g->lmax), its online-softmax state in
 * registers from the first to the last. pf: while page p is computed, the rows of the page `ahead` pages on in
 * the walk (rows_ahead) are prefetched into L2, a K and a V row per token. Inlined with constant R, NV. */
AVX512 static inline __attribute__((always_inline)) void group_avx512(
        const Ctx *c, Group *g, __m512 vscale, const Walk *w, int64_t p0, int64_t p1, int pf, int64_t ahead,
        const int R, const int NV) {
    State st;
    for (int r = 0; r < R; r++) {
        st.m[r] = g->m[r];
        st.lv[r] = g->lv[r];
        for (int j = 0; j < NV; j++) {
            st.qv[r * NV + j] = _mm512_loadu_ps(g->qrow[r] + 16 * j);
            st.acc[r * NV + j] = g->acc[r * NV + j];
        }
    }
    if (c->bf16 && !(NV & 1))                          /* queries in the order load_row_vecs gives K */
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NV; j += 2) pair_order(&st.qv[r * NV + j], &st.qv[r * NV + j + 1]);
    const int64_t bs = c->block_size, esz = c->bf16 ? 2 : 4, npages = p1 < 0 ? g->lmax / bs + 1 : p1;
    for (int64_t p = p0; p < npages; p++) {
        const int64_t t0 = p * bs, base = (int64_t)c->table[p] * c->s_block + g->kvh * c->s_head;
        const int64_t np = g->lmax + 1 - t0 < bs ? g->lmax + 1 - t0 : bs;
        const char *next = pf ? rows_ahead(c, w, g->kvh, p, ahead) : NULL;
        for (int64_t o = 0; o < np; o += 16) {
            const char *pfo = next ? next + o * c->s_tok * esz : NULL;
            if (np - o >= 16) chunk_avx512(c, &st, base + o * c->s_tok, 16, t0 + o, g->lim, vscale, pfo, R, NV, 1);
            else chunk_avx512(c, &st, base + o * c->s_tok, (int)(np - o), t0 + o, g->lim, vscale, pfo, R, NV, 0);
        }
    }
    for (int r = 0; r < R; r++) {
        g->m[r] = st.m[r];
        g->lv[r] = st.lv[r];
        for (int j = 0; j < NV; j++) g->acc[r * NV + j] = st.acc[r * NV + j];
    }
}

#define G_(F, R_, NV_) case R_: F(c, g, vscale, w, W_P0, W_P1, W_PF, W_AHEAD, R_, NV_); return;
#define UPTO2(F, NV_) G_(F, 1, NV_) G_(F, 2, NV_)
#define UPTO4(F, NV_) UPTO2(F, NV_) G_(F, 3, NV_) G_(F, 4, NV_)
#define UPTO8(F, NV_) UPTO4(F, NV_) G_(F, 5, NV_) G_(F, 6, NV_) G_(F, 7, NV_) G_(F, 8, NV_)
#define DISPATCH                                                                          \
    switch (c->D / 16) {                                                                  \
    case 1: switch (g->R) { UPTO8(group_avx512, 1) } break;                               \
    case 2: switch (g->R) { UPTO8(group_avx512, 2) } break;                               \
    case 3: switch (g->R) { UPTO4(group_avx512, 3) G_(group_avx512, 5, 3) } break;        \
    case 4: switch (g->R) { UPTO4(group_avx512, 4) } break;                               \
    case 8: switch (g->R) { UPTO2(group_avx512, 8) } break;                               \
    case 16: switch (g->R) { G_(group_avx512, 1, 16) } break;                             \
    }                                                                                     \
    group_avx512(c, g, vscale, w, W_P0, W_P1, W_PF, W_AHEAD, g->R, (int)(c->D / 16));

/* Pairs per group for NV vectors per row: queries and accumulators fill at most 2 x MAX_VECS registers. */
static inline int group_max(int64_t NV) { return (int)(MAX_VECS / NV < MAX_R ? MAX_VECS / NV : MAX_R); }

/* group_avx512 with R and NV = D/16 as constants for the common head sizes, else a generic one, over all of
 * a group's pages, every group prefetching PF_AHEAD pages ahead (head-major). The walk's settings are
 * compiled into each dispatcher: passed as variables they had cost the head-major walk 5-13% on Zen 4. */
AVX512 static void group_dispatch(const Ctx *c, Group *g, __m512 vscale, const Walk *w) {
#define W_P0 0
#define W_P1 -1
#define W_PF 1
#define W_AHEAD PF_AHEAD
    DISPATCH
#undef W_P0
#undef W_P1
#undef W_PF
#undef W_AHEAD
}

/* The same over page p only, the first group of each kv head (pf) prefetching a page ahead (page-major). */
AVX512 static void page_dispatch(const Ctx *c, Group *g, __m512 vscale, const Walk *w, int64_t p, int pf) {
#define W_P0 p
#define W_P1 (p + 1)
#define W_PF pf
#define W_AHEAD 1
    DISPATCH
#undef W_P0
#undef W_P1
#undef W_PF
#undef W_AHEAD
}

/* All query rows of sequence b: groups of its (row, head) pairs (group_avx512), walked head-major (each group
 * all its pages, its state in registers) where head_major_walk says so, else page-major (the groups of one page,
 * then the next page); groups: room for Hkv * ceil(nq * G / R_max).
 *
 * On Zen 4 the walk is head-major since 2026-11-28: a group's queries, accumulators and softmax state had gone to
 * memory and back at every page when the heads of one page were computed together (page-major), about a
 * fifth of the kernel's time on Zen 4 at 16-token pages (bench-80m, 32 x 141 tokens, all in L1/L2: 3.14 ms,
 * 2.85 with 32-token pages, 2.70 with 64; head-major 2.55-2.57 whatever the page). With the cache in DRAM the
 * shorter prefetch lead of one head's walk (a page ahead now holds one kv head's rows, not all of them) needs
 * two pages (PF_AHEAD; one: 4.22 ms, two: 3.84, four 4.05, eight 4.06 cold at 32 x 141). bench/kernel_ab.py
 * against page-major, Zen 4, two runs, cold / warm: 32 x 141 0.876-0.916 / 0.862-0.902, 32 x 1,025
 * 0.795-0.873 / 0.798-0.857, 4 x 513 0.802-0.896 / 0.812-0.832, 1 x 141 0.869-0.904 / 0.839-0.941;
 * bit-identical. The batch-32 step 0.977x, batch 1 1.008x (bench/step_ab.py). Zen 4 only measured.
 *
 * How the cache gets ahead of the arithmetic. A page's misses, taken as the arithmetic meets them,
 * stall it. Loaded all at once before the page is computed (a load_page step, kept until 2026-11-28)
 * they overlap one another but not the arithmetic, and run at what the core's L1 miss buffers allow
 * (about 13 GB/s for scattered 16 KiB pages on Zen 4, under half its streaming read). Software
 * prefetches into L1 (T0) take the same buffers: a burst of the next page's 256 lines after each
 * load_page stalls as long as the loads (Zen 5 gained from it, Zen 4 did not), and spread over the
 * page they gain nothing on Zen 4. Prefetches into L2 (T1) do not hold them: the first group of each
 * kv head prefetches that head's rows of the next page into L2, a K and a V row per token it
 * computes. bench-80m's 12 layers over a cold, scattered cache, interleaved A/Bs in one process
 * (medians, ms, load_page (+ burst on Zen 4) -> L2 rows spread):
 *   Zen 4 (EPYC 9004, KVM):            32 x 140 6.6-7.0 -> 3.9   32 x 1024 50.6 -> 27.2   4 x 512 2.96 -> 1.67
 *   Xeon model 207 (KVM, no AVX512-BF16, 2026-11-28, 11 reps):
 *                                      32 x 140 8.81 -> 6.50     32 x 1024 57.8 -> 42.6   4 x 512 3.69 -> 2.74
 *                                      1 x 140 0.52 -> 0.45 (21 reps)                     1 x 1024 2.21 -> 1.66
 * On the Xeon, prefetching two pages ahead, into L1, or keeping load_page beside the L2 prefetch was no
 * better or slower. (Before, Intel CPUs had kept load_page because a prefetch burst per page into L1
 * had stalled warm calls there on the line-fill buffers; prefetches into L2 had not been measured on
 * Intel. Cascade Lake has not been measured with them.) */
AVX512 static void sequence_avx512(const Ctx *c, Group *groups, const float *q, float *out, int64_t H,
                                   int64_t Hkv, int64_t q0, int64_t nq, int64_t L, float scale,
                                   const int32_t *seq_lens, const int32_t *tables, int64_t max_blocks,
                                   int64_t B, int64_t b) {
    const int64_t G = H / Hkv, D = c->D, NV = D / 16, R_max = group_max(NV), first = L - nq;
    int64_t n = 0;
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
        for (int64_t p0 = 0; p0 < nq * G; p0 += R_max, n++) {      /* pairs (row i, head g), R at a time */
            Group *g = groups + n;
            g->R = (int)(nq * G - p0 < R_max ? nq * G - p0 : R_max);
            g->kvh = kvh, g->lmax = 0;
            for (int r = 0; r < g->R; r++) {
                const int64_t i = (p0 + r) / G, h = kvh * G + (p0 + r) % G;
                g->qrow[r] = q + ((q0 + i) * H + h) * D;
                g->orow[r] = out + ((q0 + i) * H + h) * D;
                g->lim[r] = first + i;
                g->lmax = g->lim[r] > g->lmax ? g->lim[r] : g->lmax;
                g->m[r] = -INFINITY;
                g->lv[r] = _mm512_setzero_ps();
                for (int64_t j = 0; j < NV; j++) g->acc[r * NV + j] = _mm512_setzero_ps();
            }
        }
    const Walk w = {seq_lens, tables, max_blocks, B, Hkv, b, c->head_major};
    const __m512 vscale = _mm512_set1_ps(scale);
    if (w.head_major) {        /* every group prefetches: a kv head with several walks its pages once per group */
        if (b == 0)                                     /* the walk's first pages, before the prefetch runs ahead */
            for (int64_t a = 0; a < PF_AHEAD; a++) prefetch_head_rows(c, rows_ahead(c, &w, 0, 0, a));
        for (int64_t k = 0; k < n; k++) group_dispatch(c, groups + k, vscale, &w);
    } else {
        if (b == 0)
            for (int64_t a = 0; a < 2; a++)
                for (int64_t h = 0; h < Hkv; h++) prefetch_head_rows(c, rows_ahead(c, &w, h, 0, a));
        const int64_t npages = (L + c->block_size - 1) / c->block_size;
        for (int64_t p = 0; p < npages; p++)            /* the first group of each kv head prefetches, a page ahead */
            for (int64_t k = 0; k < n; k++)
                if (p * c->block_size <= groups[k].lmax)
                    page_dispatch(c, groups + k, vscale, &w, p, k == 0 || groups[k].kvh != groups[k - 1].kvh);
    }
    for (int64_t k = 0; k < n; k++)
        for (int r = 0; r < groups[k].R; r++) {
            if (c->bf16 && !(NV & 1))
                for (int64_t j = 0; j < NV; j += 2) dim_order(&groups[k].acc[r * NV + j], &groups[k].acc[r * NV + j + 1]);
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(groups[k].lv[r]));
            for (int64_t j = 0; j < NV; j++)
                _mm512_storeu_ps(groups[k].orow[r] + 16 * j, _mm512_mul_ps(groups[k].acc[r * NV + j], inv));
        }
}

static int forced_path;  /* pd_attention_force: 0 by the CPU, 1 AVX2, 2 portable, 3 / 4 AVX-512 page- / head-major */

/* Tests' way to reach every path on a CPU that would take another: path 0 restores the CPU's choice.
 * Returns 0, or -1 for a path this CPU cannot run (AVX2 without AVX2 and FMA, 3 and 4 without AVX-512) or
 * out of range. */
int pd_attention_force(int path) {
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (path < 0 || path > 4 || (path == 1 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        || (path >= 3 && !avx512))
        return -1;
    forced_path = path;
    return 0;
}

/* The AVX-512 path's walk: head-major on Zen 4 (AMD family 19h) for heads of up to 64 dims, where it was measured
 * faster (see sequence_avx512); page-major elsewhere, where a group-major walk with a page of prefetch lead had
 * measured 1.24-1.32x slower on Zen 5 (docs/benchmarks.md) and the two-page lead has not been measured, and for
 * larger heads: with 128 dims a group's queries and accumulators (2 x 2 x 8 vectors) no longer fit in registers
 * beside a K row, and head-major took 1.11x / 1.08x the time of page-major at 8 heads / 4 KV heads (Qwen3's
 * grouping) over a cold cache of 32 x 164 / 32 x 1,024 tokens, 1.02x / 1.08x at 16 / 4 (Llama 3's), where with
 * 64 dims it took 0.88x / 0.83x at 12 / 4 (bench-80m) and 0.89x / 0.81x at 16 / 4 (Zen 4, 11 layers,
 * interleaved, medians of 11). */
static int head_major_walk(int64_t D) {
    if (forced_path >= 3) return forced_path == 4;
    static int family = -1;                             /* CPUID leaves a VM: read once */
    if (family < 0) family = amd_family();
    return family == 0x19 && D <= 64;
}

/* q, out: float32 [num_tokens, H, D] contiguous. qs: int32 [B+1] row offsets. seq_lens: int32 [B].
 * tables: int32 [B, max_blocks]. Returns 0, or -1 if scratch memory could not be allocated. */
int pd_paged_attention(const float *q, float *out, int64_t H, int64_t Hkv, int64_t D,
                       const int32_t *qs, const int32_t *seq_lens, int64_t B,
                       const void *cache, int bf16, int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v,
                       const int32_t *tables, int64_t max_blocks, int64_t block_size, float scale) {
    __builtin_cpu_init();
    Ctx c = { cache, bf16, s_block, s_tok, s_head, s_v, block_size, D, NULL, head_major_walk(D) };
    const int fast = (!forced_path || forced_path >= 3) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                     && D % 16 == 0 && D / 16 <= MAX_VECS;
    const int avx2 = !fast && forced_path != 2 && avx2_takes(&c);
    const int64_t G = H / Hkv, R_max = fast ? group_max(D / 16) : avx2 ? RA : 8;
    int64_t max_len = 0, max_q = 0;
    for (int64_t b = 0; b < B; b++) {
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
        max_q = qs[b + 1] - qs[b] > max_q ? qs[b + 1] - qs[b] : max_q;
    }
    const int64_t ld = (max_len + 7) / 8 * 8;             /* avx2: score rows padded to 8 tokens */
    const size_t scratch = fast ? sizeof(Group) * (size_t)(Hkv * ((max_q * G + R_max - 1) / R_max))
                         : avx2 ? sizeof(float) * (size_t)(R_max * ld) + sizeof(void *) * (size_t)(2 * max_len)
                                : sizeof(float) * (size_t)(R_max * max_len + D);   /* groups / score rows */
    void *buf = aligned_alloc(64, (scratch + 63) / 64 * 64);
    if (!buf) return -1;
    if (avx2) {
        batch_avx2(&c, q, out, H, Hkv, qs, seq_lens, B, tables, max_blocks, scale, buf, ld,
                   (const uint16_t **)((float *)buf + R_max * ld), max_len);
        free(buf);
        return 0;
    }
    const float *qrow[MAX_R]; float *orow[MAX_R]; int64_t lim[MAX_R];
    for (int64_t b = 0; b < B; b++) {
        const int64_t q0 = qs[b], nq = qs[b + 1] - qs[b], L = seq_lens[b], first = L - nq;
        c.table = tables + b * max_blocks;
        if (fast) {
            sequence_avx512(&c, buf, q, out, H, Hkv, q0, nq, L, scale, seq_lens, tables, max_blocks, B, b);
            continue;
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            for (int64_t p0 = 0; p0 < nq * G; p0 += R_max) {      /* pairs (row i, head g), R at a time */
                const int R = (int)(nq * G - p0 < R_max ? nq * G - p0 : R_max);
                group_pairs(p0, R, G, H, D, kvh, q0, first, q, out, qrow, orow, lim);
                rows_portable(&c, kvh, R, qrow, orow, lim, L, scale, buf, (float *)buf + R_max * max_len);
            }
    }
    free(buf);
    return 0;
}
