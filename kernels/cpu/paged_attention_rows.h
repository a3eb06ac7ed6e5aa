/* How paged_attention.c reads the cache: a row as float32 vectors (bf16 widened, in the pair order
 * for head sizes that are multiples of 32), 16 partial dot products reduced at once, pages prefetched
 * whole. Included by paged_attention.c only, after paged_attention_portable.h (Ctx) and its AVX512
 * target macro. */
#ifndef PD_PAGED_ATTENTION_ROWS_H
#define PD_PAGED_ATTENTION_ROWS_H
#include <immintrin.h>

#include "paged_attention_portable.h"

AVX512 static inline __m512 load16(const Ctx *c, int64_t off) {
    if (c->bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c->cache + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)c->cache + off);
}

/* The NV vectors of one cache row from element offset off, as float32. A bf16 row of NV even is widened a
 * 32-element block at a time: v[2j] = its even elements (a shift), v[2j + 1] = its odd ones (a mask),
 * two single-uop operations for 32 elements where vpmovzxwd + vpslld take four; queries and
 * accumulators of such rows are kept in the same order (pair_order / dim_order). */
AVX512 static inline __attribute__((always_inline)) void load_row_vecs(const Ctx *c, int64_t off, __m512 *v, const int NV) {
    if (c->bf16 && !(NV & 1)) {
        const uint16_t *p = (const uint16_t *)c->cache + off;
        for (int j = 0; j < NV / 2; j++) {
            const __m512i w = _mm512_loadu_si512(p + 32 * j);
            v[2 * j] = bf16_even_f32(w);
            v[2 * j + 1] = bf16_odd_f32(w);
        }
        return;
    }
    for (int j = 0; j < NV; j++) v[j] = load16(c, off + 16 * j);
}

/* 32 consecutive float32 (a, b) -> (even elements, odd elements): the order load_row_vecs gives bf16 rows. */
AVX512 static inline void pair_order(__m512 *a, __m512 *b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 x = *a, y = *b;
    *a = _mm512_permutex2var_ps(x, even, y);
    *b = _mm512_permutex2var_ps(x, odd, y);
}

/* Inverse of pair_order. */
AVX512 static inline void dim_order(__m512 *a, __m512 *b) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 x = *a, y = *b;
    *a = _mm512_permutex2var_ps(x, lo, y);
    *b = _mm512_permutex2var_ps(x, hi, y);
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

/* The prefetch helpers are inlined into their AVX-512 callers: as separate functions of the default
 * target GCC 12 neither inlined them nor kept their calls (it took them for side-effect free), so
 * until 2026-11-27 this kernel's per-token software prefetches were absent from the build (objdump:
 * 0 or 2 prefetch instructions), and the prefetch distances and hints measured before then measured
 * nothing. Present, a per-token T0 prefetch of the next-but-one page cost 18% of a warm call (Zen 5,
 * batch 32 x 140, one layer: 0.173 -> 0.205 ms); the per-token prefetch kept is into L2 and of the
 * next page (sequence_avx512). */
#define PREFETCH AVX512 static inline __attribute__((always_inline))

PREFETCH void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* Into L2 only (T1): no L1 miss buffer held while the line comes (sequence_avx512). */
PREFETCH void prefetch_row_l2(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* The K and V rows of one kv head in a page (`rows`: its token 0; NULL: none). */
PREFETCH void prefetch_head_rows(const Ctx *c, const char *rows) {
    const int64_t esz = c->bf16 ? 2 : 4, rowb = c->D * esz;
    for (int64_t o = 0; rows && o < c->block_size; o++) {
        prefetch_row(rows + o * c->s_tok * esz, rowb);
        prefetch_row(rows + (o * c->s_tok + c->s_v) * esz, rowb);
    }
}

#endif
