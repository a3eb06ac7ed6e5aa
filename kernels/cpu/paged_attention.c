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
 * are taken R at a time with their queries and output accumulators held in registers, so
 * each K/V row is loaded once per R pairs:
 *
 *   pass 1   s[r][t] = scale * <q_r, K_t>            t <= limit_r
 *   softmax  p[r][t] = exp(s[r][t] - max_t s[r]) / sum_t exp(...)
 *   pass 2   out_r   = sum_t p[r][t] V_t
 *
 * Exact two-pass softmax in float32 whatever the cache dtype, per sequence, as
 * PagedAttention v1 (Kwon et al., SOSP 2023). Each output row depends only on its own
 * sequence: batch-invariant. The AVX-512 path takes head_dim % 16 == 0 and head_dim <= 256;
 * other shapes and CPUs use the portable path.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma omp declare simd notinbranch
extern float expf(float);                                /* glibc's vector variants (libmvec) */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define MAX_VECS 16                          /* zmm registers of queries (and of accumulators) */

typedef struct {
    const void *cache; int bf16; int64_t s_block, s_tok, s_head, s_v, block_size, D;
    const int32_t *table;
} Ctx;

static inline int64_t kv_offset(const Ctx *c, int64_t t, int64_t kvh) {
    return (int64_t)c->table[t / c->block_size] * c->s_block + (t % c->block_size) * c->s_tok + kvh * c->s_head;
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static void load_row(const Ctx *c, int64_t off, float *dst) {
    if (c->bf16) {
        const uint16_t *p = (const uint16_t *)c->cache + off;
        for (int64_t d = 0; d < c->D; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)c->cache + off, (size_t)c->D * sizeof(float));
    }
}

/* p = softmax(s[0..n)) in place, n >= 1 */
static void softmax(float *s, int64_t n) {
    float mx = s[0], sum = 0.f;
    for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* Portable: rows qrow[r] (float32, D) with limits lim[r] -> orow[r]; scores has R x L floats. */
static void rows_portable(const Ctx *c, int64_t kvh, int R, const float **qrow, float **orow,
                          const int64_t *lim, int64_t L, float scale, float *scores, float *buf) {
    const int64_t D = c->D;
    for (int64_t t = 0; t < L; t++) {
        load_row(c, kv_offset(c, t, kvh), buf);
        for (int r = 0; r < R; r++) {
            if (t > lim[r]) continue;
            float s = 0.f;
            for (int64_t d = 0; d < D; d++) s += qrow[r][d] * buf[d];
            scores[r * L + t] = scale * s;
        }
    }
    for (int r = 0; r < R; r++) { softmax(scores + r * L, lim[r] + 1); memset(orow[r], 0, D * sizeof(float)); }
    for (int64_t t = 0; t < L; t++) {
        load_row(c, kv_offset(c, t, kvh) + c->s_v, buf);
        for (int r = 0; r < R; r++) {
            if (t > lim[r]) continue;
            const float p = scores[r * L + t];
            for (int64_t d = 0; d < D; d++) orow[r][d] += p * buf[d];
        }
    }
}

/* Ask for the K and V rows of head kvh in the block holding position t, ahead of use. */
static inline void prefetch_block(const Ctx *c, int64_t t, int64_t kvh) {
    const int64_t off = kv_offset(c, t, kvh), row = c->D * (c->bf16 ? 2 : 4);
    const char *base = (const char *)c->cache + off * (c->bf16 ? 2 : 4);
    const int64_t s_tok = c->s_tok * (c->bf16 ? 2 : 4), s_v = c->s_v * (c->bf16 ? 2 : 4);
    for (int64_t o = 0; o < c->block_size; o++)
        for (int64_t b = 0; b < row; b += 64) {
            __builtin_prefetch(base + o * s_tok + b);
            __builtin_prefetch(base + s_v + o * s_tok + b);
        }
}

AVX512 static inline __m512 load16(const Ctx *c, int64_t off) {
    if (c->bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c->cache + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)c->cache + off);
}

/* Lane m of the result = sum of the 16 lanes of a[m]: a transpose-and-add tree, 60 shuffles and adds
 * for 16 sums instead of 16 separate reductions. After the tree, lane 4k + j holds a[k + 4j]. */
AVX512 static inline __m512 hsum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

/* AVX-512 over R pairs with V = D/16 vectors each; inlined with constant V and R, so queries and
 * accumulators live in registers. Pairs past the real count carry lim = -1 and are skipped. */
AVX512 static inline __attribute__((always_inline)) void rows_avx512_impl(
        const Ctx *c, int64_t kvh, const int R, const float **qrow, float **orow, const int64_t *lim,
        int64_t L, float scale, float *scores, const int V) {
    const int64_t Ls = (L + 15) / 16 * 16;      /* score row stride: whole groups of 16 */
    __m512 qv[MAX_VECS], acc[MAX_VECS], kv[MAX_VECS];
    int64_t lmax = 0;
    for (int r = 0; r < R; r++) {
        if (lim[r] > lmax) lmax = lim[r];
        for (int j = 0; j < V; j++) qv[r * V + j] = lim[r] >= 0 ? _mm512_loadu_ps(qrow[r] + 16 * j) : _mm512_setzero_ps();
    }
    __m512 part[MAX_VECS][16];                  /* per pair: 16 positions' unreduced products */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0, off = 0, o = 0; t0 <= lmax; t0 += 16) {
        for (int tt = 0; tt < 16; tt++) {
            const int64_t t = t0 + tt;
            if (t > lmax) {
                for (int r = 0; r < R; r++) part[r][tt] = _mm512_setzero_ps();
                continue;
            }
            if (o == c->block_size || t == 0) {
                off = kv_offset(c, t, kvh);
                o = 0;
                if (t + c->block_size <= lmax) prefetch_block(c, t + c->block_size, kvh);
            }
            for (int j = 0; j < V; j++) kv[j] = load16(c, off + 16 * j);
            for (int r = 0; r < R; r++) {
                __m512 s = _mm512_mul_ps(qv[r * V], kv[0]);
                for (int j = 1; j < V; j++) s = _mm512_fmadd_ps(qv[r * V + j], kv[j], s);
                part[r][tt] = s;
            }
            off += c->s_tok, o++;
        }
        for (int r = 0; r < R; r++)             /* past lim[r]: written, never read */
            _mm512_storeu_ps(scores + r * Ls + t0, _mm512_mul_ps(vscale, hsum16(part[r])));
    }
    for (int r = 0; r < R; r++) if (lim[r] >= 0) softmax(scores + r * Ls, lim[r] + 1);
    for (int i = 0; i < R * V; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0, off = 0, o = 0; t <= lmax; t++, off += c->s_tok, o++) {
        if (o == c->block_size || t == 0) { off = kv_offset(c, t, kvh) + c->s_v; o = 0; }
        for (int j = 0; j < V; j++) kv[j] = load16(c, off + 16 * j);
        for (int r = 0; r < R; r++) {
            if (t > lim[r]) continue;
            const __m512 p = _mm512_set1_ps(scores[r * Ls + t]);
            for (int j = 0; j < V; j++) acc[r * V + j] = _mm512_fmadd_ps(p, kv[j], acc[r * V + j]);
        }
    }
    for (int r = 0; r < R; r++)
        if (lim[r] >= 0)
            for (int j = 0; j < V; j++) _mm512_storeu_ps(orow[r] + 16 * j, acc[r * V + j]);
}

AVX512 static void rows_avx512(const Ctx *c, int64_t kvh, const float **qrow, float **orow, const int64_t *lim,
                               int64_t L, float scale, float *scores) {
    switch (c->D / 16) {   /* R = MAX_VECS / V pairs per pass */
    case 1: rows_avx512_impl(c, kvh, 16, qrow, orow, lim, L, scale, scores, 1); break;
    case 2: rows_avx512_impl(c, kvh, 8, qrow, orow, lim, L, scale, scores, 2); break;
    case 4: rows_avx512_impl(c, kvh, 4, qrow, orow, lim, L, scale, scores, 4); break;
    case 8: rows_avx512_impl(c, kvh, 2, qrow, orow, lim, L, scale, scores, 8); break;
    default: rows_avx512_impl(c, kvh, (int)(MAX_VECS / (c->D / 16)), qrow, orow, lim, L, scale, scores,
                              (int)(c->D / 16));
    }
}

/* q, out: float32 [num_tokens, H, D] contiguous. qs: int32 [B+1] row offsets. seq_lens: int32 [B].
 * tables: int32 [B, max_blocks]. Returns 0, or -1 if scratch memory could not be allocated. */
int pd_paged_attention(const float *q, float *out, int64_t H, int64_t Hkv, int64_t D,
                       const int32_t *qs, const int32_t *seq_lens, int64_t B,
                       const void *cache, int bf16, int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v,
                       const int32_t *tables, int64_t max_blocks, int64_t block_size, float scale) {
    __builtin_cpu_init();
    const int fast = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                     && D % 16 == 0 && D / 16 <= MAX_VECS;
    const int R_max = fast ? (int)(MAX_VECS / (D / 16)) : 8;
    const int64_t G = H / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    max_len = (max_len + 15) / 16 * 16;                                 /* score rows padded to 16 */
    float *scores = malloc(sizeof(float) * (size_t)(R_max * max_len + D));
    if (!scores) return -1;
    Ctx c = { cache, bf16, s_block, s_tok, s_head, s_v, block_size, D, NULL };
    const float *qrow[MAX_VECS]; float *orow[MAX_VECS]; int64_t lim[MAX_VECS];
    for (int64_t b = 0; b < B; b++) {
        const int64_t q0 = qs[b], nq = qs[b + 1] - qs[b], L = seq_lens[b], first = L - nq;
        c.table = tables + b * max_blocks;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            for (int64_t p0 = 0; p0 < nq * G; p0 += R_max) {      /* pairs (row i, head g), R at a time */
                const int R = (int)(nq * G - p0 < R_max ? nq * G - p0 : R_max);
                for (int r = 0; r < R_max; r++) {
                    const int64_t i = (p0 + r) / G, h = kvh * G + (p0 + r) % G;
                    qrow[r] = r < R ? q + ((q0 + i) * H + h) * D : q;
                    orow[r] = r < R ? out + ((q0 + i) * H + h) * D : out;
                    lim[r] = r < R ? first + i : -1;
                }
                if (fast) rows_avx512(&c, kvh, qrow, orow, lim, L, scale, scores);
                else rows_portable(&c, kvh, R, qrow, orow, lim, L, scale, scores, scores + R_max * max_len);
            }
        }
    }
    free(scores);
    return 0;
}
