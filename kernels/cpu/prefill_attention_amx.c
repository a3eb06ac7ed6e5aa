/* Causal attention of prefill chunks over the paged bf16 KV cache on AMX tiles.
 *
 * The online-softmax walk of prefill_attention.c (FlashAttention: Dao et al., 2022), with both products
 * on tdpbf16ps. prefill_attention.h packs each KV head's keys and values in exactly the B-tile layouts:
 *
 *   Kp [L/32][D/2][32][2]: a B tile of the scores is 16 dim pairs x 16 keys (64 of a row's 128 bytes)
 *   Vp [L/2][D][2]:        a B tile of the value sums is 16 key pairs x 16 dims (stride 4 D bytes)
 *
 *   per query tile of R <= 16 rows (Q in a zero-padded buffer, one A tile per 32 dims):
 *     per key tile of 32 at or before the tile's last position:
 *       S = Q Kp^T                                   two C tiles (keys 0-15, 16-31), D/32 steps each
 *       softmax step as prefill_attention.c (scale, causal mask, conditional rescale past SLACK)
 *       P = bf16(exp(S - m))                         one A tile (R rows x 32 keys)
 *       O = alpha O + P Vp                           64 dims in C tiles 4-7 across key tiles (rescaled
 *                                                    when a row's max moves); heads over 64 dims walk the
 *                                                    key tiles again per further 64, on the P kept
 *     out = O / l, rounded to bf16
 *
 * P is rounded to bf16 for the value sums as FlashAttention rounds it for its matrix units (the
 * dot-product build of prefill_attention.c does the same); scores and sums are float32. Head sizes must
 * be multiples of 32 (an A tile's 32 bf16): kernels/cpu/attention.py sends others to the build that follows
 * the bf16 GEMM (prefill_library).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NK 32                     /* keys per tile: two C tiles of scores */
#define SLACK 8.f                 /* as prefill_attention.c: the reference max moves past this only */
#define RMAX 16                   /* query rows per tile: an A tile's rows */
#define MAX_D 256
static void tiles_done(void);
#define PD_PREFILL_DONE() tiles_done()   /* the tiles kept configured across a call's query tiles */
#include "prefill_attention.h"
#include "prefill_softmax.h"
#include "amx.h"

int pd_cpu_supported(void) { return amx_bf16_granted(); }      /* asked by kernels.cpu.available */

/* Tiles 0-1 S (R rows), 2 the A operand (Q, then P; R rows), 3 the B operand (K, then V; 16 pair rows), 4-7 64
 * dims of O (16 dims each, R rows). */
AMX static void tile_config(int R) {
    const uint8_t r = (uint8_t)R;
    amx_config((const uint8_t[8]){r, r, r, 16, r, r, r, r});
}

/* The rows the tiles are configured for on this thread (0: released): consecutive query tiles of as many rows keep
 * the configuration, and the call's end releases it (PD_PREFILL_DONE), where each query tile had loaded and released
 * its own. */
static __thread int configured;

AMX static void tiles_for(int R) {
    if (configured != R) {
        tile_config(R);
        configured = R;
    }
}

AMX static void tiles_done(void) {
    if (configured) _tile_release();
    configured = 0;
}

/* The tile work that runs beside key tile t's softmax, its steps spread over the softmax's rows: tile t + 1's
 * scores stored from tiles 0-1 (issued a key tile earlier), tile t - 1's value sums, tile t + 2's scores issued.
 * Issued from inside the softmax's row loop rather than as a block before it, the tile loads and products overlap the
 * vector work: in a scratch loop of this sequence and 16 softmax rows, as a block the two took the sum of their times
 * (143 ns against 59 and 67 alone), spread one step a row 117 ns (AMX Xeon 167). One tile instruction a step rather
 * than a load and its product: 1.01-1.06x the kernel's time. */
typedef struct {
    float (*s_next)[NK];            /* where tile t + 1's scores go, or NULL (no tile t + 1) */
    const uint16_t (*p_prev)[NK];   /* tile t - 1's P, or NULL (t = 0) */
    const uint16_t *v_prev;         /* its packed values */
    const uint16_t *k_next2;        /* tile t + 2's packed keys, or NULL */
    uint16_t (*Q)[MAX_D];
    int64_t D, w0;
} TileWork;

/* Step s of the tile work (0 <= s < tile_steps(D)); a step whose work does not exist this key tile is empty. */
AMX static inline void tile_step(const TileWork *w, int s) {
    if (s < 2) {                                               /* 0-1: tile t + 1's scores out */
        if (!w->s_next) return;
        if (s == 0) _tile_stored(0, w->s_next[0], NK * 4);
        else _tile_stored(1, w->s_next[0] + 16, NK * 4);
    } else if (s < 6) {                                        /* 2-5: tile t - 1's value sums, 16 dims a step */
        const int j = s - 2;
        if (!w->p_prev || 16 * j >= w->w0) return;
        if (j == 0) _tile_loadd(2, w->p_prev[0], NK * 2);
        _tile_loadd(3, w->v_prev + 32 * j, w->D * 4);
        switch (j) {                                           /* tile numbers are immediates */
        case 0: _tile_dpbf16ps(4, 2, 3); break;
        case 1: _tile_dpbf16ps(5, 2, 3); break;
        case 2: _tile_dpbf16ps(6, 2, 3); break;
        default: _tile_dpbf16ps(7, 2, 3); break;
        }
    } else if (w->k_next2) {                                   /* 6..: tile t + 2's scores, as issue_scores */
        const int64_t j = s - 6, d0 = 32 * (j / 2);
        if (j == 0) { _tile_zero(0); _tile_zero(1); }
        if (j % 2 == 0) {
            _tile_loadd(2, w->Q[0] + d0, MAX_D * 2);
            _tile_loadd(3, w->k_next2 + d0 * NK, NK * 4);
            _tile_dpbf16ps(0, 2, 3);
        } else {
            _tile_loadd(3, w->k_next2 + d0 * NK + 32, NK * 4);
            _tile_dpbf16ps(1, 2, 3);
        }
    }
}

static inline int tile_steps(int64_t D) { return 6 + 2 * (int)(D / 32); }

/* Key tile kt's raw scores of the query tile Q into tiles 0-1 (keys 0-15, 16-31): Q (tile 2) x K (tile 3),
 * D/32 steps (tile_step's score steps, in a block); issued only, stored by the caller a key tile later. */
AMX static void issue_scores(uint16_t (*Q)[MAX_D], const uint16_t *kt, int64_t D) {
    const TileWork w = {NULL, NULL, NULL, kt, Q, D, 0};
    for (int s = 6; s < tile_steps(D); s++) tile_step(&w, s);
}

/* Each row's softmax step over key tile t's stored scores S (prefill_softmax.h): P (bf16), alpha, the
 * row's state; the tile work w's steps spread evenly before the rows (as for RMAX rows; those past the last row
 * after it). first: the lowest of the rows' positions; key tiles that every row sees whole (all but a query tile's
 * last one or two) take a loop without the rows' key counts and masks (one layer of bench-80m 0.94-0.97x / 0.94-0.95x
 * at 512 / 2,048 tokens, 32 heads of 128 dims 0.98x; bit-identical; no gain while the tile work ran as a block).
 * Returns whether a row's alpha is not 1. */
AMX static int softmax_rows(int R, int64_t t, const int64_t *pos, int64_t first, __m512 sc, float s2,
                            float (*S)[NK], uint16_t (*P)[NK], SoftRow *rows, float *alpha, const TileWork *w) {
    int rescale = 0;
    const Pow2K k = pow2_pinned();
    const int steps = tile_steps(w->D);
    int s = 0;
    __m512 p0, p1;
    if (first - t * NK + 1 >= NK) {                  /* every row sees the whole tile: no key counts, no masks */
        for (int r = 0; r < R; r++) {
            for (const int until = (r + 1) * steps / RMAX; s < until; s++) tile_step(w, s);
            rescale |= softmax_tile(_mm512_load_ps(S[r]), _mm512_load_ps(S[r] + 16), NK, sc, s2, &rows[r], &alpha[r],
                                    &p0, &p1, &k);
            _mm512_store_si512(P[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));     /* keys 0..15, 16..31 */
        }
    } else {
        for (int r = 0; r < R; r++) {
            for (const int until = (r + 1) * steps / RMAX; s < until; s++) tile_step(w, s);
            const int64_t n = tile_keys(pos[r], t, &alpha[r], P[r], sizeof P[r]);
            if (n <= 0) continue;
            const __m512 s0 = _mm512_load_ps(S[r]), s1 = _mm512_load_ps(S[r] + 16);
            if (n >= NK) rescale |= softmax_tile(s0, s1, NK, sc, s2, &rows[r], &alpha[r], &p0, &p1, &k);
            else rescale |= softmax_tile(s0, s1, n, sc, s2, &rows[r], &alpha[r], &p0, &p1, &k);
            _mm512_store_si512(P[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
    }
    for (; s < steps; s++) tile_step(w, s);
    return rescale;
}

/* O tiles 4.. (w = 32 or 64 dims) += P (loaded into tile 2) x the packed values vt, dims d1..d1+w. */
AMX static void accumulate_pv(uint16_t (*P)[NK], const uint16_t *vt, int64_t D, int64_t d1, int64_t w) {
    _tile_loadd(2, P[0], NK * 2);
    _tile_loadd(3, vt + 2 * d1, D * 4); _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, vt + 2 * d1 + 32, D * 4); _tile_dpbf16ps(5, 2, 3);
    if (w == 64) {
        _tile_loadd(3, vt + 2 * d1 + 64, D * 4); _tile_dpbf16ps(6, 2, 3);
        _tile_loadd(3, vt + 2 * d1 + 96, D * 4); _tile_dpbf16ps(7, 2, 3);
    }
}

/* O tiles 4.. (w dims) -> the float32 rows' columns d1.. (Ob, MAX_D floats a row). */
AMX static void o_store(float (*Ob)[MAX_D], int64_t d1, int64_t w) {
    _tile_stored(4, Ob[0] + d1, MAX_D * 4); _tile_stored(5, Ob[0] + d1 + 16, MAX_D * 4);
    if (w == 64) { _tile_stored(6, Ob[0] + d1 + 32, MAX_D * 4); _tile_stored(7, Ob[0] + d1 + 48, MAX_D * 4); }
}

/* O tiles 4.. (w dims) times each row's alpha, through the rows' columns d1.. (a row's max moved). */
AMX static void o_rescale(int R, float (*Ob)[MAX_D], int64_t d1, int64_t w, const float *alpha) {
    o_store(Ob, d1, w);
    for (int r = 0; r < R; r++)
        for (int64_t j = d1; j < d1 + w; j += 16)
            _mm512_store_ps(Ob[r] + j, _mm512_mul_ps(_mm512_load_ps(Ob[r] + j), _mm512_set1_ps(alpha[r])));
    _tile_loadd(4, Ob[0] + d1, MAX_D * 4); _tile_loadd(5, Ob[0] + d1 + 16, MAX_D * 4);
    if (w == 64) { _tile_loadd(6, Ob[0] + d1 + 32, MAX_D * 4); _tile_loadd(7, Ob[0] + d1 + 48, MAX_D * 4); }
}

/* One key tile's softmax output, kept by heads over 64 dims for the passes over their further dims. */
typedef struct { uint16_t P[RMAX][NK] __attribute__((aligned(64))); float alpha[RMAX]; int rescale; } KeyTile;

/* This thread's history of at least n key tiles (grown, kept), or NULL if it cannot be allocated. */
static KeyTile *history(int64_t n) {
    static __thread KeyTile *h;
    static __thread int64_t cap;
    if (n > cap) {
        KeyTile *grown = aligned_alloc(64, (size_t)n * sizeof(KeyTile));
        if (!grown) return NULL;
        free(h);
        h = grown;
        cap = n;
    }
    return h;
}

/* One query tile of R rows (bf16 query vectors qr[r], positions pos[r]) against keys [0, max pos],
 * writing bf16 rows orow[r]. D % 32 == 0 (tile_any checks). Software-pipelined by two key tiles: while the
 * vector softmax of tile t runs, tile t + 1's scores (issued a key tile earlier) are stored, P V of tile t - 1
 * is added and tile t + 2's scores are issued, each tile step between two of the softmax's rows (TileWork), so
 * the matrix unit works while the vector units do; scores and P alternate between two buffers. Since
 * 2026-12-02 (the tile work a block before the softmax, one key tile ahead, before): one layer of bench-80m
 * 0.83-0.84x / 0.88x the time at 512 / 2,048 tokens, 8 heads of 128 dims 0.90x / 0.94x, 32 of 128 (8 KV heads)
 * 1.03x / 0.96-0.98x; whole bench-80m prefills 0.991x / 0.925x (bit-identical; bench/kernel_ab.py,
 * bench/step_ab.py, AMX Xeon 167). 64 dims of O stay in tiles 4-7 across key tiles, through memory only when a row
 * rescales (with SLACK, rarely after its first tiles). Heads over 64 dims (128: Llama, Qwen, Mistral) keep
 * each key tile's P and alphas in this first walk and add the further dims' P V in one more walk over the
 * key tiles per 64 dims, tile products only. Until 2026-11-30 every head size but 64 added all of O into
 * float32 rows at every key tile; since, one layer at 512 / 2,048 tokens takes 0.81x / 0.75x the time with
 * 128-dim heads, 0.71x / 0.69x with 256, 0.94x / 1.00x with 64 (bit-identical; bench/kernel_ab.py, AMX Xeon
 * model 167). Returns 0, or -1 if the history could not be allocated. */
AMX static int tile(int R, const uint16_t *const *qr, const int64_t *pos, uint16_t *const *orow,
                    const uint16_t *kp, const uint16_t *vp, int64_t D, float scale) {
    uint16_t Q[RMAX][MAX_D] __attribute__((aligned(64)));
    float S[2][RMAX][NK] __attribute__((aligned(64))), Ob[RMAX][MAX_D] __attribute__((aligned(64)));
    float l[RMAX], alpha[RMAX];
    SoftRow rows[RMAX];                                 /* per-lane running sums: reduced once at the end */
    uint16_t P[2][RMAX][NK] __attribute__((aligned(64)));   /* tiles t and t - 1 (heads of up to 64 dims) */
    float *O[RMAX];
    int64_t last = 0, first = pos[0];
    for (int r = 0; r < R; r++) {
        memcpy(Q[r], qr[r], sizeof(uint16_t) * (size_t)D);
        O[r] = Ob[r];
        soft_row_init(&rows[r]);
        last = pos[r] > last ? pos[r] : last;
        first = pos[r] < first ? pos[r] : first;
    }
    const int64_t tiles = last / NK + 1, w0 = D < 64 ? D : 64;
    KeyTile *h = NULL;
    if (D > 64 && !(h = history(tiles))) return -1;
    tiles_for(R);
    const __m512 sc = _mm512_set1_ps(scale * LOG2E);            /* the softmax walks in base 2 */
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    issue_scores(Q, kp, D);
    _tile_stored(0, S[0][0], NK * 4);
    _tile_stored(1, S[0][0] + 16, NK * 4);
    if (tiles > 1) issue_scores(Q, kp + NK * D, D);
    uint16_t (*prev)[NK] = NULL;
    for (int64_t t = 0; t < tiles; t++) {
        const TileWork work = {t + 1 < tiles ? S[(t + 1) & 1] : NULL, (const uint16_t (*)[NK])prev,
                               t > 0 ? vp + (t - 1) * NK * D : vp, t + 2 < tiles ? kp + (t + 2) * NK * D : NULL, Q, D, w0};
        uint16_t (*p)[NK] = h ? h[t].P : P[t & 1];
        float *a = h ? h[t].alpha : alpha;
        const int rescale = softmax_rows(R, t, pos, first, sc, scale * LOG2E, S[t & 1], p, rows, a, &work);
        if (h) h[t].rescale = rescale;
        if (rescale && t > 0) o_rescale(R, Ob, 0, w0, a);      /* at t = 0 the tiles hold zeros */
        prev = p;
    }
    accumulate_pv(prev, vp + (tiles - 1) * NK * D, D, 0, w0);
    o_store(Ob, 0, w0);
    for (int64_t d1 = 64; d1 < D; d1 += 64) {                  /* heads over 64 dims: the rest, 64 at a time */
        const int64_t w = D - d1 < 64 ? D - d1 : 64;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int64_t t = 0; t < tiles; t++) {
            if (t > 0 && h[t].rescale) o_rescale(R, Ob, d1, w, h[t].alpha);
            accumulate_pv(h[t].P, vp + t * NK * D, D, d1, w);
        }
        o_store(Ob, d1, w);
    }
    for (int r = 0; r < R; r++) l[r] = _mm512_reduce_add_ps(rows[r].lv);
    write_rows(R, O, l, orow, D);
    return 0;
}

/* A head size the tiles cannot take (D % 32) writes NaN rows rather than reading past them; the caller
 * (kernels/cpu/attention.py: prefill_library) sends such heads to the other builds. */
static int tile_any(int R, const uint16_t *const *qr, const int64_t *pos, uint16_t *const *orow,
                    const uint16_t *kp, const uint16_t *vp, int64_t D, float scale) {
    if (D % 32 == 0) return tile(R, qr, pos, orow, kp, vp, D, scale);
    for (int r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) orow[r][d] = 0x7fc0;
    return 0;
}

PD_PREFILL_ENTRY(tile_any)
