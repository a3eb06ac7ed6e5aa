/* AMX: the gemv's packed weights as B tiles, for a few to a few hundred activation rows (included by
 * gemv_bf16.c: the same library and packed layout).
 *
 * A 16-kk slice of a 16-row weight block, Wp[nb][kk0 .. kk0+16][16][2], is 16 rows of 64 bytes:
 * exactly an AMX bf16 B tile (K/2 rows x 16 columns x 2). A tiles (up to 16 rows x 32 bf16) are loaded
 * from x itself, with as many rows as x has, up to 32 rows; beyond, x is copied into a zero-padded scratch
 * (per thread, grown and kept) of a multiple of 32 rows. C tiles are up to 16 x 16 float32.
 *
 *   up to 16 rows:  for each 64 output columns (4 B tiles, four weight streams):   4 C tiles
 *                       for each 32 input columns:  C[j] += A B[j]                 (tdpbf16ps)
 *   more rows:      for each 32 output columns (2 B tiles), each 32 rows of x (2 A tiles):  4 C tiles
 *                       for each 32 input columns:  C[i][j] += A[i] B[j]
 *   from 128 rows:  the same per group of rows (x of a group fits half the L2) and per slice of 256 input columns
 *                   (K <= 1,024), the sums carried between slices in memory, the next slice's weights brought
 *                   into L2 a few lines a step (amx_rows32_sliced)
 *
 * Every weight byte comes from memory once; each stream is prefetched AMX_AHEAD input columns ahead into
 * L2. Decode is bound by that stream, and tile loads that miss the L1 keep fewer lines in flight than
 * vector loads do: on an AMX Xeon (model 167 under KVM, 2026-11-28) a microbenchmark of tile loads and
 * tdpbf16ps over 1 GiB of B read 9.9 GB/s with one stream and no software prefetch, 13.7 with two
 * prefetched, 14.5 with four prefetched into L2 (T0, T1 and T2 alike from two streams; NTA 6 GB/s), where
 * a C streaming read reaches 17.6. The same loop over 1 MiB of B (in L2) runs at ~85 GB/s: arithmetic is
 * not the bound at these row counts.
 */
#include "amx.h"

#define AMX_AHEAD 128                            /* input columns of prefetch lead per weight stream (4 KiB) */

/* 1 if AMX-BF16 is present and the kernel lets this process use tile data. */
int pd_cpu_has_amx_bf16(void) { return amx_bf16_granted(); }

/* The 16 lines (1 KiB) of B a stream reads AMX_AHEAD columns after k0, into L2. In a panel's last AMX_AHEAD
 * columns the lead runs past the stream's block (K columns) into the next block, which a stream beside it has
 * just read: there it is moved on by `spill` elements, to the same stream's block of the next panel (spill =
 * (streams - 1) x 16 K), so that every stream starts its next panel with its first lines in flight, as the
 * FMA gemm's row tiles bring in the next chunk. Bit-identical; bench-80m's 48 projections, L3 evicted
 * (bench/kernel_ab.py --kernel gemm_bf16_amx, AMX Xeon model 167, 2026-12-01, 9-11 rounds): 4 rows 0.961x, 8
 * rows 0.944-0.995x, 16 rows 0.974x, 32 rows 0.996x (its two streams from memory are not what bounds it). */
#define AMX_PREFETCH(b, k0, K, spill)                                                                          \
    for (int l = 0; l < 1024; l += 64)                                                                         \
    _mm_prefetch((const char *)((b) + ((k0) + AMX_AHEAD) * 16 + ((k0) + AMX_AHEAD >= (K) ? (spill) : 0)) + l, \
                 _MM_HINT_T1)

/* C tiles 0..nt-1 (rows 16 x 16 columns each, side by side) -> y rows [0, rows), columns nb.. (< n_valid). */
AMX static void amx_store(float *c, int64_t rows, uint16_t *y, int64_t ldy, int64_t nb, int64_t n_valid, int nt,
                          int c_stride) {
    for (int64_t i = 0; i < rows; i++)
        for (int j = 0; j < 16 * nt && nb + j < n_valid; j += 16) {
            const int64_t cnt = n_valid - nb - j < 16 ? n_valid - nb - j : 16;
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_loadu_ps(c + i * c_stride + j));
            _mm256_mask_storeu_epi16(y + i * ldy + nb + j, (__mmask16)((1u << cnt) - 1), (__m256i)o);
        }
}

/* Up to 16 rows (A: tile 4, M rows, stride lda elements): four B streams at a time (tiles 5, 6, 7, and 5
 * again; 16 rows each), C in 0-3 (M rows). */
AMX static void amx_rows16(const uint16_t *a, int64_t lda, int64_t M, int64_t K, const uint16_t *wp, int64_t Np,
                           int64_t n_valid, uint16_t *y, int64_t ldy, float *c) {
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 64) {
        const int64_t nt = (Np - nb) / 16 < 4 ? (Np - nb) / 16 : 4;
        const uint16_t *b0 = wp + nb * K, *b1 = b0 + 16 * K, *b2 = b1 + 16 * K, *b3 = b2 + 16 * K;
        const int64_t spill = 3 * 16 * K;                        /* to the same stream's next panel */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        if (nt == 4) {
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                AMX_PREFETCH(b0, k0, K, spill); AMX_PREFETCH(b1, k0, K, spill);
                AMX_PREFETCH(b2, k0, K, spill); AMX_PREFETCH(b3, k0, K, spill);
                _tile_loadd(4, a + k0, lda * 2);
                _tile_loadd(5, b0 + k0 * 16, 64);
                _tile_loadd(6, b1 + k0 * 16, 64);
                _tile_loadd(7, b2 + k0 * 16, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, b3 + k0 * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        } else {                                 /* the last 1-3 blocks */
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                _tile_loadd(4, a + k0, lda * 2);
                _tile_loadd(5, b0 + k0 * 16, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nt > 1) { _tile_loadd(6, b1 + k0 * 16, 64); _tile_dpbf16ps(1, 4, 6); }
                if (nt > 2) { _tile_loadd(7, b2 + k0 * 16, 64); _tile_dpbf16ps(2, 4, 7); }
            }
        }
        _tile_stored(0, c, 256); _tile_stored(1, c + 16, 256); _tile_stored(2, c + 32, 256); _tile_stored(3, c + 48, 256);
        amx_store(c, M, y, ldy, nb, n_valid, (int)nt, 64);
    }
}

/* One 32-column step of a 32 x 32 block: A tiles 4-5 (rows 0-15, 16-31 of a, stride lda elements), B tiles 6-7 (the
 * two weight blocks' 16-pair rows at b0, b1; the second only where `two`), C tiles 0-3 += their products. */
AMX static inline __attribute__((always_inline)) void amx_step32(const uint16_t *a, int64_t lda, const uint16_t *b0,
                                                                 const uint16_t *b1, int two) {
    _tile_loadd(4, a, lda * 2);
    _tile_loadd(5, a + 16 * lda, lda * 2);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Rows 32 at a time (A: tiles 4-5, stride lda elements; Mp rows, a multiple of 32, or M <= 32 rows as
 * configured): two B streams (tiles 6-7), C in 0-3. */
AMX static void amx_rows32(const uint16_t *a, int64_t lda, int64_t M, int64_t Mp, int64_t K, const uint16_t *wp,
                           int64_t Np,
                           int64_t n_valid, uint16_t *y, int64_t ldy, float *c) {
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 32) {    /* weights outer: each B block is read from */
        const int two = nb + 16 < Np;                             /* memory once, then from cache per 32 rows */
        const uint16_t *b0 = wp + nb * K, *b1 = b0 + 16 * K;
        const int64_t spill = 16 * K;                             /* to the same stream's next panel */
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                if (m0 == 0) { AMX_PREFETCH(b0, k0, K, spill); if (two) AMX_PREFETCH(b1, k0, K, spill); }
                amx_step32(a + m0 * lda + k0, lda, b0 + k0 * 16, b1 + k0 * 16, two);
            }
            _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 16 * 32, 128); _tile_stored(3, c + 16 * 32 + 16, 128);
            amx_store(c, M - m0 < 32 ? M - m0 : 32, y + m0 * ldy, ldy, nb, n_valid, two ? 2 : 1, 32);
        }
    }
}

/* *buf with at least `need` bytes (64-byte aligned, whole 4 KiB pages), grown where *cap is short; the old contents are
 * not kept. Returns 0, or -1 if it could not grow (*buf then as it was). */
static int scratch(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    const size_t round = (need + 4095) / 4096 * 4096;
    void *grown = aligned_alloc(64, round);
    if (!grown) return -1;
    free(*buf);
    *buf = grown;
    *cap = round;
    return 0;
}

#define AMX_SLICED_ROWS 128   /* rows from which pd_gemm_bf16_amx runs amx_rows32_sliced (see pd_gemm_bf16_amx_side) */

/* Input columns per slice of the gemm beyond 32 rows: K in slices of 256 where K <= 1,024, else whole. */
static inline int64_t amx_k_slice(int64_t K) { return K <= 1024 && K > 256 ? 256 : K; }

/* Vector work run beside a gemm's tile work (pd_gemm_bf16_amx_side): rows of a SwiGLU piece's SiLU-and-mul, by
 * fused.c's pd_silu_mul_to (another library: passed in). */
typedef void (*pd_silu_fn)(const void *gate_up, int64_t n, int64_t inter, int64_t ld, void *out, int64_t ldo, int bf16);
typedef struct { pd_silu_fn fn; const uint16_t *gate_up; int64_t inter, ld; uint16_t *out; int64_t ldo, from, to, done; } SideWork;

/* The side work's rows up to `target`. */
static inline void side_to(SideWork *s, int64_t target) {
    if (!s->fn || target <= s->done) return;
    s->fn(s->gate_up + s->done * s->ld, target - s->done, s->inter, s->ld, s->out + s->done * s->ldo, s->ldo, 1);
    s->done = target;
}

/* Rows 32 at a time as amx_rows32, for M > 32: full row blocks read from x itself (lda), the last partial one from
 * `tail` (32 zero-padded rows of K); the input columns in slices of ks (partial sums through cp, Mp / 32 blocks of
 * 32 x 32 float32), so that a panel's slice stays in L1 across the row blocks; the side work's rows spread over the
 * row-block steps, each call after a step's tile products are issued, so that they run beside them. */
AMX static void amx_rows32_sliced(const uint16_t *a, int64_t lda, const uint16_t *tail, int64_t M, int64_t K,
                                  int64_t ks, const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y,
                                  int64_t ldy, float *cp, SideWork *side) {
    const int64_t Mp = (M + 31) / 32 * 32, mfull = M / 32 * 32;
    const int64_t steps = (Np + 31) / 32 * ((K + ks - 1) / ks) * (Mp / 32);
    int64_t step = 0;
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 32) {
        const int two = nb + 16 < Np;
        const uint16_t *b0 = wp + nb * K, *b1 = b0 + 16 * K;
        for (int64_t k1 = 0; k1 < K; k1 += ks) {
            const int64_t k2 = k1 + ks < K ? k1 + ks : K;
            /* the next slice's weights (this panel's, else the next panel's first), 32 bytes a column a block, both
             * blocks, brought into L2 a few lines each k step of every row block */
            const char *n0 = (const char *)(k2 < K ? b0 + k2 * 16 : b0 + 32 * K);
            const int64_t nbytes = (k2 < K ? (K - k2 < ks ? K - k2 : ks) : (K < ks ? K : ks)) * 32;
            const int64_t pf_steps = Mp / 32 * ((k2 - k1) / 32), per = (2 * nbytes / 64 + pf_steps - 1) / pf_steps;
            const int pf = nb + 32 < Np || k2 < K;
            int64_t line = 0;
            for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                const uint16_t *am = m0 < mfull ? a + m0 * lda : tail;
                const int64_t ld = m0 < mfull ? lda : K;
                float *part = cp + (m0 / 32) * 32 * 32;
                if (k1 == 0) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                } else {
                    _tile_loadd(0, part, 128); _tile_loadd(1, part + 16, 128);
                    _tile_loadd(2, part + 16 * 32, 128); _tile_loadd(3, part + 16 * 32 + 16, 128);
                }
                for (int64_t k0 = k1; k0 < k2; k0 += 32) {
                    for (int64_t i = 0; pf && i < per && line < 2 * nbytes / 64; i++, line++)
                        _mm_prefetch(n0 + (line & 1) * 16 * K * 2 + (line >> 1) * 64, _MM_HINT_T1);
                    amx_step32(am + k0, ld, b0 + k0 * 16, b1 + k0 * 16, two);
                }
                side_to(side, side->from + ++step * (side->to - side->from) / steps);
                _tile_stored(0, part, 128); _tile_stored(1, part + 16, 128);
                _tile_stored(2, part + 16 * 32, 128); _tile_stored(3, part + 16 * 32 + 16, 128);
                if (k2 == K) amx_store(part, M - m0 < 32 ? M - m0 : 32, y + m0 * ldy, ldy, nb, n_valid, two ? 2 : 1, 32);
            }
        }
    }
    side_to(side, side->to);
}

/* y = x W^T as pd_gemm_bf16_amx, for M > 32 rows (pd_gemm_bf16_amx's plan from AMX_SLICED_ROWS rows): x read in
 * place, the input columns in slices of ks (a multiple of 32; K or more: one slice; 0: amx_k_slice's), rows in
 * groups whose x fits half the L2; and beside its tile work, where fn is not NULL, rows [0, side_rows) of
 * fn(gate_up, ., inter, ld, out, ldo, 1): another SwiGLU piece's SiLU-and-mul (bf16). The same sums in the same order as the other plans
 * (bit-identical). bench-80m's 48 projections against the plan of 33-127 rows (bench/kernel_ab.py --kernel
 * gemm_bf16_amx, L3 evicted, AMX Xeon 167): 128 rows 0.81x, 256 0.75x, 512 0.75x, 2,048 0.57x; 12 distinct weights
 * of each shape at 512 rows against oneDNN's prepacked matmul (GFLOP/s): 1,611 / 1,421 (N 1,280, K 768), 1,458 /
 * 1,279 (1,024 x 768), 1,336 / 1,191 (768 x 2,048), 1,055 / 982 (4,096 x 4,096), 1,069 / 992 (1,024 x 4,096).
 * Returns -1 if out of memory, -2 without AMX, -3 for M <= 32. */
AMX int pd_gemm_bf16_amx_side(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t Np,
                              int64_t n_valid, uint16_t *y, int64_t ldy, int64_t ks, pd_silu_fn fn,
                              const uint16_t *gate_up, int64_t inter, int64_t ld, uint16_t *out, int64_t ldo,
                              int64_t side_rows) {
    static __thread void *cp, *tail;             /* partial sums; the last partial row block, zero-padded; grown, kept */
    static __thread size_t cp_bytes, tail_bytes;
    static int granted = -1;
    if (granted < 0) granted = pd_cpu_has_amx_bf16();
    if (!granted) return -2;
    if (M <= 32) return -3;
    const int64_t Mp = (M + 31) / 32 * 32, rest = M % 32;
    const size_t need = (size_t)Mp * 32 * 4, tneed = (size_t)32 * K * 2;
    if (scratch(&cp, &cp_bytes, need) || (rest && scratch(&tail, &tail_bytes, tneed))) return -1;
    if (rest) {
        memset(tail, 0, tneed);
        for (int64_t m = 0; m < rest; m++)
            memcpy((uint16_t *)tail + m * K, x + (M - rest + m) * ldx, (size_t)K * 2);
    }
    const int64_t srows = fn ? side_rows : 0;
    if (ks <= 0) ks = amx_k_slice(K);
    amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
    /* rows in groups whose bf16 rows fit half the L2 (1 MiB; 128 to 512 rows): each group's x stays in L2 across the
     * weight panels, and each group reads the weights once more */
    int64_t group = (int64_t)(1 << 20) / (2 * K) / 32 * 32;
    group = group < 128 ? 128 : group > 512 ? 512 : group;
    for (int64_t g0 = 0; g0 < M; g0 += group) {
        const int64_t gm = M - g0 < group ? M - g0 : group;
        SideWork side = {fn, gate_up, inter, ld, out, ldo, srows * g0 / M, srows * (g0 + gm) / M, srows * g0 / M};
        amx_rows32_sliced(x + g0 * ldx, ldx, tail, gm, K, ks < K ? ks : K, wp, Np, n_valid, y + g0 * ldy, ldy, cp,
                          &side);
    }
    _tile_release();
    return 0;
}

/* As pd_gemv_bf16, for K % 32 == 0 and any M. Returns -1 if out of memory, -2 if this CPU or process cannot
 * use AMX (asked once per process). */
AMX int pd_gemm_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                         const uint16_t *wp, int64_t Np, int64_t n_valid, uint16_t *y, int64_t ldy) {
    static int granted = -1;
    static __thread void *a;                     /* A scratch [Mp][K] for 33..AMX_SLICED_ROWS - 1 rows, zero-padded */
    static __thread size_t a_bytes;
    static __thread float c[16 * 64] __attribute__((aligned(64)));
    if (granted < 0) granted = pd_cpu_has_amx_bf16();
    if (!granted) return -2;
    if (M <= 0) return 0;
    const uint8_t m = (uint8_t)(M < 16 ? M : 16), rest = (uint8_t)(M > 32 ? 16 : M > 16 ? M - 16 : 0);
    if (M <= 16) {
        amx_config((const uint8_t[8]){m, m, m, m, m, 16, 16, 16});
        amx_rows16(x, ldx, M, K, wp, Np, n_valid, y, ldy, c);
    } else if (M <= 32) {
        amx_config((const uint8_t[8]){16, 16, rest, rest, 16, rest, 16, 16});
        amx_rows32(x, ldx, M, 32, K, wp, Np, n_valid, y, ldy, c);
    } else if (M >= AMX_SLICED_ROWS) {
        return pd_gemm_bf16_amx_side(x, M, K, ldx, wp, Np, n_valid, y, ldy, amx_k_slice(K), NULL, NULL, 0, 0, NULL, 0, 0);
    } else {
        const int64_t Mp = (M + 31) / 32 * 32;
        if (scratch(&a, &a_bytes, (size_t)(Mp * K * 2))) return -1;
        for (int64_t m = 0; m < Mp; m++) {
            if (m < M) memcpy((uint16_t *)a + m * K, x + m * ldx, (size_t)K * 2);
            else memset((uint16_t *)a + m * K, 0, (size_t)K * 2);
        }
        amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
        amx_rows32(a, K, M, Mp, K, wp, Np, n_valid, y, ldy, c);
    }
    _tile_release();
    return 0;
}

/* The tile unit's own limits, for bench/limits.py (through kernels/cpu/amx_probe.py); each returns -2 without AMX.
 *
 * pd_amx_tdp_probe: `rounds` x four independent TDPBF16PS (C tiles 0-3 from A tiles 4-5 and B tiles 6-7,
 * loaded once from src's first 4 KiB), no memory traffic: the matrix unit's issue rate. Returns C[0][0] of
 * tile 0, 32 x rounds where src holds bf16 1.0 (the caller's check that the loop ran as built).
 *
 * pd_amx_tile_load_probe: `rounds` x four 1 KiB tile loads (16 rows of 64 bytes, contiguous) walking the
 * first `bytes` of src (a multiple of 4 KiB) and wrapping: the tile load rate from wherever `bytes` of data
 * stay (L1, L2, L3). Returns the first 4 bytes of the last tile loaded, as a float32 (so no load is dead). */
AMX float pd_amx_tdp_probe(const uint16_t *src, int64_t rounds) {
    float c[16 * 16] __attribute__((aligned(64)));
    if (!pd_cpu_has_amx_bf16()) return -2.0f;
    amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, src, 64); _tile_loadd(5, src + 512, 64); _tile_loadd(6, src + 1024, 64); _tile_loadd(7, src + 1536, 64);
    for (int64_t r = 0; r < rounds; r++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0];
}

/* pd_amx_stream_probe: read `bytes` of src (a multiple of 48 KiB; DRAM-sized for the figure) once with vector
 * loads as the 32-row gemm walks packed weights of K = 768 (panels of two 16-row blocks, 24 KiB each, side by
 * side: 1 KiB of each a step), prefetched 2 KiB ahead as the gemv streams on Intel. Each step also runs what a
 * 32-row gemm must per 2 KiB of weights, in part or whole: tile_work bit 0, four 1 KiB tile loads (two of x, two
 * of weights; here from a 4 KiB buffer in L1); bit 1, four TDPBF16PS (a 2 x 2 block of C tiles, on tiles loaded
 * once where bit 0 is clear). Its rate against tile_work 0's is what that work costs a weight stream (figures in
 * kernels/cpu/amx_probe.py). Returns a float that depends on every load and product (so none is dead). */
AMX float pd_amx_stream_probe(const uint16_t *src, int64_t bytes, int tile_work) {
    enum { K = 768, BLOCK = 16 * K };                         /* elements of a 16-row block */
    uint16_t l1[2048] __attribute__((aligned(64)));
    float c[16 * 16] __attribute__((aligned(64)));
    if (!pd_cpu_has_amx_bf16()) return -2.0f;
    memcpy(l1, src, sizeof l1);
    amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, l1, 64); _tile_loadd(5, l1 + 512, 64); _tile_loadd(6, l1 + 1024, 64); _tile_loadd(7, l1 + 1536, 64);
    __m512i v = _mm512_setzero_si512();
    for (int64_t p = 0; p + 2 * BLOCK <= bytes / 2; p += 2 * BLOCK) {
        const uint16_t *b0 = src + p, *b1 = b0 + BLOCK;
        for (int64_t e = 0; e < BLOCK; e += 512) {            /* 1 KiB of each block */
            for (int l = 0; l < 512; l += 32) {
                _mm_prefetch((const char *)(b0 + e + l + 1024), _MM_HINT_T0);
                _mm_prefetch((const char *)(b1 + e + l + 1024), _MM_HINT_T0);
                v = _mm512_or_si512(v, _mm512_or_si512(_mm512_loadu_si512(b0 + e + l), _mm512_loadu_si512(b1 + e + l)));
            }
            if (tile_work & 1) { _tile_loadd(4, l1, 64); _tile_loadd(5, l1 + 512, 64); _tile_loadd(6, l1 + 1024, 64); }
            if (tile_work & 2) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); }
            if (tile_work & 1) _tile_loadd(7, l1 + 1536, 64);
            if (tile_work & 2) { _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7); }
        }
    }
    _tile_stored(0, c, 64);
    _tile_release();
    int32_t o[16] __attribute__((aligned(64)));
    _mm512_store_si512(o, v);
    return c[0] + (float)(o[0] & 0xffff);
}

AMX float pd_amx_tile_load_probe(const uint16_t *src, int64_t bytes, int64_t rounds) {
    float c[16 * 16] __attribute__((aligned(64)));
    if (!pd_cpu_has_amx_bf16()) return -2.0f;
    amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
    const int64_t elems = bytes / 2;
    int64_t at = 0;
    for (int64_t r = 0; r < rounds; r++) {
        _tile_loadd(4, src + at, 64); _tile_loadd(5, src + at + 512, 64);
        _tile_loadd(6, src + at + 1024, 64); _tile_loadd(7, src + at + 1536, 64);
        at += 2048;
        if (at + 2048 > elems) at = 0;
    }
    _tile_stored(7, c, 64);
    _tile_release();
    return c[0];
}
