/* The next weight chunk of a packed bf16 GEMM, prefetched by the row tiles of the current one.
 *
 * The packed GEMMs (gemv_bf16.c, gemm_bf16_avx2.c; gemm_bf16_fma.c keeps a stream per tile and has
 * a block of the next chunk brought in per tile, without this walk's bookkeeping, see there) walk the weights
 * Wp [Np/16][K/2][16][2] in panels of NR 16-output blocks, each panel in chunks of KC kk pairs, and run
 * every row tile of the activations over a chunk while it sits in cache. One kk pair of one block is one
 * 64-byte line. A prefetch running a fixed distance ahead inside the first tile's stream covered only
 * that tile's time; with several tiles per chunk the weights then stood still in memory for the rest
 * of the chunk and the next chunk's first tile waited on them. Here every tile of a chunk takes an
 * equal share of the next chunk's lines and issues them a few per k step, so the next chunk streams in
 * over the whole of the current one (with gemv_bf16.c's larger chunks, bench-80m's 48 projections from
 * DRAM on an AMD EPYC Zen 4 core, bench/cpu_kernels.py: 8 rows 14.9 -> 7.4 ms, 32 rows 30.0 -> 22.3 ms).
 * A lone tile (at most a tile's rows) keeps its own in-stream prefetch: its chunk is computed once, so
 * nothing stands still.
 * Included by the GEMM sources only.
 */
#ifndef PD_CHUNK_AHEAD_H
#define PD_CHUNK_AHEAD_H
#include <immintrin.h>
#include <stdint.h>

/* A chunk: the line of block 0 at its first pair, its blocks (nr) and pairs (kn), the blocks' stride
 * (16 K elements). w = NULL: no chunk. */
typedef struct { const uint16_t *w; int64_t nr, kn, block; } Chunk;

/* The chunk after panel nb (nr blocks) at pairs [k0, k0 + kn): the same panel's next pairs, else the
 * next panel's first KC pairs, else none. Panels step by NR blocks and stop at Np and n_valid. */
static inline Chunk chunk_after(const uint16_t *wp, int64_t Np, int64_t n_valid, int64_t K, int64_t nb,
                                int64_t nr, int64_t k0, int64_t kn, int64_t NR, int64_t KC) {
    const int64_t K2 = K / 2, next = nb + 16 * NR;
    Chunk c = {NULL, 0, 0, 16 * K};
    if (k0 + kn < K2) {
        c.w = wp + nb * K + (k0 + kn) * 32, c.nr = nr, c.kn = K2 - k0 - kn < KC ? K2 - k0 - kn : KC;
    } else if (next < Np && next < n_valid) {
        const int64_t left = (Np - next) / 16;
        c.w = wp + next * K, c.nr = left < NR ? left : NR, c.kn = K2 < KC ? K2 : KC;
    }
    return c;
}

/* Row tile t of `tiles` prefetching its share of chunk *c, lines [l, end), over `steps` k steps: `per`
 * lines a step. Line l is pair l % kn of block l / kn; the walk keeps that pair (p) and block (b) as it
 * goes, the division done once here: a 64-bit division per k step issued once per 24-90 cycles on a
 * Cascade Lake core, as long as the step's FMAs, and halved the FMA GEMM's rate there at 32 rows. */
typedef struct { const Chunk *c; int64_t l, end, per, b, p; } Ahead;

static inline Ahead ahead_share(const Chunk *c, int64_t t, int64_t tiles, int64_t steps) {
    Ahead a = {c, 0, 0, 0, 0, 0};
    if (!c->w || tiles < 2 || steps < 1) return a;
    const int64_t lines = c->nr * c->kn;
    a.l = lines * t / tiles, a.end = lines * (t + 1) / tiles, a.per = (a.end - a.l + steps - 1) / steps;
    a.b = a.l / c->kn, a.p = a.l % c->kn;
    return a;
}

/* One k step's prefetches (into L2: T0 measured slower on Zen 4, the lines would crowd the chunk in L1). */
static inline __attribute__((always_inline)) void ahead_step(Ahead *a) {
    for (int64_t i = 0; i < a->per && a->l < a->end; i++, a->l++) {
        _mm_prefetch((const char *)(a->c->w + a->b * a->c->block + a->p * 32), _MM_HINT_T1);
        if (++a->p == a->c->kn) a->p = 0, a->b++;
    }
}

#endif
