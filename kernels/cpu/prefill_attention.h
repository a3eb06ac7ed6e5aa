/* What the two prefill attention kernels share (prefill_attention.c on AVX-512, prefill_attention_avx2.c
 * on AVX2): the paged cache's reader, the packing of one KV head's keys and values into the operand
 * layouts of their key tiles, and the walk over sequences, KV heads and query tiles. The including file
 * defines NK (keys per key tile), RMAX (query rows per tile) and MAX_D first, and passes its tile
 * function to prefill_run. Included only; kernels/cpu/__init__.py keys its build cache on headers too.
 */
#ifndef PD_PREFILL_ATTENTION_H
#define PD_PREFILL_ATTENTION_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <xmmintrin.h>

#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

typedef struct {
    const uint16_t *cache;        /* one layer */
    int64_t s_block, s_tok, s_head, s_v, block_size;
    const int32_t *table;
} Paged;

/* rows[j] = key j's row of KV head kvh for j < L (its value row lies s_v further), the blocks walked in order:
 * no division per key. */
static void kv_rows(const Paged *c, int64_t kvh, int64_t L, const uint16_t **rows) {
    for (int64_t b = 0, j = 0; j < L; b++) {
        const uint16_t *base = c->cache + c->table[b] * c->s_block + kvh * c->s_head;
        for (int64_t off = 0; off < c->block_size && j < L; off++, j++) rows[j] = base + off * c->s_tok;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* r[c] = column c of the 16 x 16 matrix of 32-bit words whose row i is r[i] (two unpack stages within each
 * 128-bit lane, then two across lanes). */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {              /* lane l of r[i + k]: rows i..i+3, column 4 l + k */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {              /* lanes of t[i + k]: columns k, 8 + k of rows i.., i+4.. */
            t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0x88);
            t[i + 4 + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
        r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
    }
}
#endif

/* Kp[t][p][k][e] = K[NK t + k][2 p + e] and Vp[j / 2][d][e] = V[2 (j / 2) + e][d] (zero past L):
 * the B operands of the score products (pairs of dims, NK keys a tile) and of the value sums (pairs of keys).
 * rows: scratch for L row pointers (kv_rows). A key's dim pairs move as 32-bit words: with AVX-512 16 keys x
 * 16 pairs at a time through a transpose of words, and two V rows interleaved 32 dims at a time (vpermt2w);
 * else element by element. Only the last key tile is cleared first. Until 2026-12-02 the keys moved a word at
 * a time and every row's address took a division: 0.08 ms of the AMX build's ~1 ms a layer of bench-80m at
 * 512 tokens. */
static void pack_kv(const Paged *c, int64_t kvh, int64_t L, int64_t D, uint16_t *kp, uint16_t *vp,
                    const uint16_t **rows) {
    const int64_t tiles = (L + NK - 1) / NK;
    memset(kp + (tiles - 1) * NK * D, 0, sizeof(uint16_t) * (size_t)(NK * D));
    memset(vp + (L / 2) * 2 * D, 0, sizeof(uint16_t) * (size_t)((tiles * NK - L / 2 * 2) * D));
    kv_rows(c, kvh, L, rows);
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; j < L; j += 16)                                   /* keys j.. (zero past L), dims d.. (D % 16 == 0) */
        for (int64_t d = 0; d < D; d += 32) {
            const __mmask32 m = D - d >= 32 ? 0xffffffffu : 0xffffu;
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = j + i < L ? _mm512_maskz_loadu_epi16(m, rows[j + i] + d) : _mm512_setzero_si512();
            transpose16x16(r);
            uint16_t *dst = kp + (j / NK) * NK * D + (j % NK) * 2;
            for (int64_t p = 0; p < (D - d >= 32 ? 16 : 8); p++) _mm512_storeu_si512(dst + (d / 2 + p) * NK * 2, r[p]);
        }
    j = 0;
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(interleave), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (; D % 32 == 0 && j + 1 < L; j += 2) {
        const uint16_t *v0 = rows[j] + c->s_v, *v1 = rows[j + 1] + c->s_v;
        uint16_t *vd = vp + (j / 2) * 2 * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = _mm512_loadu_si512(v0 + d), b = _mm512_loadu_si512(v1 + d);
            _mm512_storeu_si512(vd + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vd + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
#else
    for (; j < L; j++) {
        uint16_t *dst = kp + (j / NK) * NK * D + (j % NK) * 2;
        for (int64_t p = 0; p < D / 2; p++) memcpy(dst + p * NK * 2, rows[j] + 2 * p, 4);    /* one 32-bit move */
    }
    j = 0;
#endif
    for (; j < L; j++) {
        const uint16_t *v = rows[j] + c->s_v;
        uint16_t *vd = vp + (j / 2) * 2 * D + (j % 2);
        for (int64_t d = 0; d < D; d++) vd[2 * d] = v[d];
    }
}

/* One query tile of R <= RMAX rows (their bf16 query vectors qr[r] at positions pos[r]) against keys
 * [0, max pos] of the packed kp / vp, writing bf16 rows orow[r]. Returns 0, or -1 if it could not allocate
 * scratch memory. */
typedef int (*tile_fn)(int R, const uint16_t *const *qr, const int64_t *pos, uint16_t *const *orow,
                       const uint16_t *kp, const uint16_t *vp, int64_t D, float scale);

/* out rows = O / l, rounded to bf16 (nearest even): the last step of a query tile. With AVX-512 16 columns at a
 * time (D % 16 == 0, prefill_run checks), the rounding bf16.h's f32_to_bf16_x16, bit-identical to the scalar
 * loop; the scalar loop took ~0.1 ms of the AMX build's 1 ms a layer of bench-80m at 512 tokens. */
static inline void write_rows(int R, float *const *O, const float *l, uint16_t *const *orow, int64_t D) {
    for (int r = 0; r < R; r++) {
        const float inv = 1.f / l[r];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(orow[r] + d), _mm512_cvtepi32_epi16(f32_to_bf16_x16(
                _mm512_mul_ps(_mm512_loadu_ps(O[r] + d), _mm512_set1_ps(inv)))));
#else
        for (int64_t d = 0; d < D; d++) orow[r][d] = f32_to_bf16(O[r][d] * inv);
#endif
    }
}

/* pd_prefill_attention's walk (arguments as there): per sequence and KV head, pack its keys and values,
 * then run tile over query tiles of RMAX rows (the group's heads of consecutive tokens). Until 2026-11-30 a
 * tile held whole tokens only (bench-80m's 3 heads a KV head: 15 of the AMX build's 16 rows). */
static int prefill_run(tile_fn tile, const uint16_t *q, uint16_t *out, int64_t H, int64_t Hkv, int64_t D,
                       const int32_t *qs, const int32_t *seq_lens, int64_t B, const uint16_t *cache,
                       int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v, const int32_t *tables,
                       int64_t max_blocks, int64_t block_size, float scale) {
    if (D % 16 || D > MAX_D || H % Hkv) return -2;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const int64_t tiles = (max_len + NK - 1) / NK;
    uint16_t *kp = aligned_alloc(64, ((size_t)(tiles * NK * D) * 2 + 63) / 64 * 64);
    uint16_t *vp = aligned_alloc(64, ((size_t)(tiles * NK * D) * 2 + 63) / 64 * 64);
    const uint16_t **rows = malloc(sizeof(*rows) * (size_t)(tiles * NK + 1));
    if (!kp || !vp || !rows) { free(kp); free(vp); free(rows); return -1; }
    const int64_t G = H / Hkv;
    for (int64_t b = 0; b < B; b++) {
        const int64_t q0 = qs[b], nq = qs[b + 1] - qs[b], L = seq_lens[b], first = L - nq;
        Paged c = { cache, s_block, s_tok, s_head, s_v, block_size, tables + b * max_blocks };
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            pack_kv(&c, kvh, L, D, kp, vp, rows);
            /* the (token, head) rows of the group in token-major order, RMAX a tile: a tile may span tokens
             * (each row has its own causal limit), so no tile is short but the last */
            for (int64_t f0 = 0; f0 < nq * G; f0 += RMAX) {
                const uint16_t *qr[RMAX]; uint16_t *orow[RMAX]; int64_t pos[RMAX];
                const int R = (int)(nq * G - f0 < RMAX ? nq * G - f0 : RMAX);
                for (int r = 0; r < R; r++) {
                    const int64_t i = (f0 + r) / G, h = kvh * G + (f0 + r) % G, row = (q0 + i) * H + h;
                    qr[r] = q + row * D; orow[r] = out + row * D; pos[r] = first + i;
                }
                if (tile(R, qr, pos, orow, kp, vp, D, scale)) { free(kp); free(vp); free(rows); return -1; }
            }
        }
    }
    free(kp); free(vp); free(rows);
    return 0;
}

/* MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6), set for the duration of each call and
 * restored after it: the exponentials' results under 2^-126 are 0 rather than subnormals, which take a
 * microcode assist on Intel cores (prefill_softmax.h; torch leaves both bits clear). */
#define PD_MXCSR_FTZ_DAZ 0x8040u

#ifndef PD_PREFILL_DONE                /* what a build does once a call's query tiles are done (AMX: release the tiles) */
#define PD_PREFILL_DONE() ((void)0)
#endif

/* The exported entry of each build, over its tile function:
 * q, out: bf16 [num_tokens, H, D] contiguous. qs: int32 [B + 1] row offsets; seq_lens: int32 [B]
 * (the new tokens are each sequence's last qs[b+1] - qs[b] positions, their K/V already in the
 * cache). cache: one layer, strides in elements as paged_attention.c. tables: int32 [B, max_blocks].
 * Returns 0; -1 if scratch memory could not be allocated; -2 for a head size it does not take
 * (D must be a multiple of 16, at most 256). */
#define PD_PREFILL_ENTRY(TILE)                                                                              \
    int pd_prefill_attention(const uint16_t *q, uint16_t *out, int64_t H, int64_t Hkv, int64_t D,          \
                             const int32_t *qs, const int32_t *seq_lens, int64_t B, const uint16_t *cache, \
                             int64_t s_block, int64_t s_tok, int64_t s_head, int64_t s_v,                  \
                             const int32_t *tables, int64_t max_blocks, int64_t block_size, float scale) { \
        const unsigned csr = _mm_getcsr();                                                                 \
        _mm_setcsr(csr | PD_MXCSR_FTZ_DAZ);                                                                \
        const int rc = prefill_run(TILE, q, out, H, Hkv, D, qs, seq_lens, B, cache, s_block, s_tok, s_head, \
                                   s_v, tables, max_blocks, block_size, scale);                            \
        PD_PREFILL_DONE();                                                                                 \
        _mm_setcsr(csr);                                                                                   \
        return rc;                                                                                         \
    }

#endif
