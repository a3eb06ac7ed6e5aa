/* INT4 weights x int8 activations on AMX-INT8 tiles, for several activation rows (included by gemv_int4.c,
 * after int4_gemv.h: the same library, packed layout and activation quantization).
 *
 * The VNNI kernel multiplies every activation row by the unpacked weight nibbles on vector lanes, so at 32
 * rows it issues 32 times the vpdpbusd of one row: bench-80m INT4 at batch 32 took 25-35 ms a step on an
 * AMX Xeon (model 207, 2026-11-28), slower than the same model in bf16 on AMX tiles (17-18 ms). Here each
 * group's integer dot products run on tiles (tdpbsud: signed xq rows times unsigned q):
 *
 *   A tile  xq rows m0..m0+15, columns k..k+KS of one group, straight from xq (row stride Kp)    16 x KS bytes
 *   B tile  q of 16 output rows, the same KS columns, unpacked from the nibbles in L1:  KS/4 rows x 16 x 4 bytes
 *   C tile  16 x 16 int32: dot(q, xq) of the group, exact (|dot| <= 127 * 15 * G)
 *
 * The packed weight Wq[nb][kb][j][b] (gemv_int4.c) is one 64-byte load per 8 columns; its low nibbles are
 * the B tile's row of columns 8kb..8kb+3 and its high nibbles the row of 8kb+4..8kb+7, so a group unpacks
 * with an and and a shift per load into a staging buffer of B rows. Each group's C tile then goes through
 * the VNNI kernel's float steps in its order (f = dot * sx, y = fma(f, s, y), yz = fma(zc, sxs, yz),
 * out = y + yz): the two kernels are bit-identical, so a row's output still does not depend on its batch.
 *
 * Loop order: weights outer (two 16-row blocks side by side, each streamed from memory once and prefetched
 * into L2 as the VNNI kernel does), then groups, then 32-row chunks of activations; y and yz per row live in
 * a per-thread scratch (rows x 32 x 2 floats), xq in L1/L2. The float steps of one (group, chunk) job run
 * after the next job's tile products are issued (C double-buffered). On the Xeon above the tile unit does
 * not overlap tile loads with products (~177 ns a job: 8 loads, 8 products, 4 stores), and the tiles
 * (~3.3 ms of bench-80m's 48 projections at 32 rows), the float steps (~2 ms) and the 45 MiB weight stream
 * (~3 ms) barely overlap: 9.5-10.5 ms in all. Slicing the float steps between the next job's products
 * measured 1.07-1.25x slower.
 */
#include "amx.h"

#define AMX8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
/* Fewer rows take the VNNI kernel: bench/kernel_ab.py --kernel gemv_int4 (bench-80m's 48 INT4 projections,
 * AMX Xeon model 207, 9 rounds) tiles against vectors at 4 / 6 / 8 / 12 rows, L3 evicted: 1.12 / 0.97 / 0.90 /
 * 0.84x; warm 1.24 / 0.99 / 0.92 / 0.80x; 0.61-0.66x at 16 and 32 rows, 0.58x at 64. */
#define AMX_INT4_MIN_ROWS 8

/* 1 if AMX-INT8 is present and the kernel lets this process use tile data (asked once). */
static int int4_amx_granted(void) {
    static int granted = -1;
    if (granted < 0) {
        __builtin_cpu_init();
        granted = __builtin_cpu_supports("amx-int8") && amx_tile_data_granted();
    }
    return granted;
}

int pd_int4_amx_available(void) { return int4_amx_granted(); }
int pd_int4_amx_min_rows(void) { return AMX_INT4_MIN_ROWS; }     /* kernels/cpu/int4.py's AMX_MIN_ROWS, tested */

/* Tiles: 0, 1 C of rows 0-15 of a 32-row chunk, blocks 0, 1; 2, 3 the same for rows 16-31; 4, 5 A of rows
 * 0-15 and 16-31; 6, 7 B of blocks 0, 1 (ks / 4 rows). lo, hi: rows of the chunk's two halves (hi may be 0:
 * tiles 2, 3, 5 unused). ks: columns per product (32 or 64). */
AMX8 static void int4_amx_config(int lo, int hi, int ks) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    const uint8_t h = (uint8_t)(hi ? hi : 1);
    const uint8_t rows[8] = {(uint8_t)lo, (uint8_t)lo, h, h, (uint8_t)lo, h, (uint8_t)(ks / 4), (uint8_t)(ks / 4)};
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = (uint16_t)(t == 4 || t == 5 ? ks : 64); cfg.rows[t] = rows[t]; }
    _tile_loadconfig(&cfg);
}

/* *p holds at least need bytes (64-byte aligned; grown, contents dropped). Returns 0, or -1 out of memory. */
static int grow(void **p, size_t *have, size_t need) {
    if (need <= *have) return 0;
    void *q = aligned_alloc(64, (need + 63) / 64 * 64);
    if (!q) return -1;
    free(*p);
    *p = q, *have = need;
    return 0;
}

/* Group g of nbl blocks (wb, block stride ws bytes) -> stage[b] as B rows [G / 4][64], prefetching pf ahead. */
AMX8 static inline void int4_unpack(const uint8_t *wb, int64_t ws, int nbl, int64_t g, int64_t G, int64_t pf,
                                    uint8_t *stage) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nbl; b++) {
        const uint8_t *w = wb + b * ws + g * G * 8;
        uint8_t *s = stage + b * G * 16;
        for (int64_t kb = 0; kb < G / 8; kb++) {
            _mm_prefetch((const char *)(w + kb * 64 + pf), _MM_HINT_T1);
            const __m512i v = _mm512_loadu_si512(w + kb * 64);
            _mm512_store_si512(s + kb * 128, _mm512_and_si512(v, low));
            _mm512_store_si512(s + kb * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

/* The float steps of one group for rows [m0, m0 + rows) of nbl blocks: c int32 [b][32 rows][16]. */
AMX8 static inline void int4_amx_epilogue(const int32_t *c, int64_t m0, int64_t rows, int nbl, const float *sx,
                                          const float *sxs, int64_t Gs, int64_t g, const float *s, const float *zc,
                                          int64_t sstride, float *acc) {
    for (int b = 0; b < nbl; b++) {
        const __m512 sb = _mm512_loadu_ps(s + b * sstride + g * 16), zb = _mm512_loadu_ps(zc + b * sstride + g * 16);
        for (int64_t i = 0; i < rows; i++) {
            float *y = acc + ((m0 + i) * 2 + b) * 32, *yz = y + 16;
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + (b * 32 + i) * 16)),
                                           _mm512_set1_ps(sx[(m0 + i) * Gs + g]));
            _mm512_store_ps(y, _mm512_fmadd_ps(f, sb, _mm512_load_ps(y)));
            _mm512_store_ps(yz, _mm512_fmadd_ps(zb, _mm512_set1_ps(sxs[(m0 + i) * Gs + g]), _mm512_load_ps(yz)));
        }
    }
}

/* One group's products for the 32-row chunk at m0 (a: xq, row stride Kp; two: its second half has rows),
 * nbl blocks (B rows at bg), into c [b][32][16]: four independent C tiles, so the tile unit overlaps them. */
AMX8 static inline void int4_amx_job(const int8_t *a, int64_t Kp, int64_t G, int ks, const uint8_t *bg, int nbl,
                                     int two, int32_t *c) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < G; k += ks) {
        _tile_loadd(4, a + k, Kp);
        _tile_loadd(6, bg + k * 16, 64);
        _tile_dpbsud(0, 4, 6);
        if (two) { _tile_loadd(5, a + 16 * Kp + k, Kp); _tile_dpbsud(2, 5, 6); }
        if (nbl > 1) {
            _tile_loadd(7, bg + G * 16 + k * 16, 64);
            _tile_dpbsud(1, 4, 7);
            if (two) _tile_dpbsud(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    if (two) _tile_stored(2, c + 256, 64);
    if (nbl > 1) { _tile_stored(1, c + 512, 64); if (two) _tile_stored(3, c + 768, 64); }
}

/* As pd_int4_gemv_q, on AMX-INT8 tiles. Returns 0, -1 if out of memory, -2 if AMX-INT8 is not usable. */
AMX8 static int int4_gemm_amx_q(const int8_t *xq, const float *sx, const float *sxs, int64_t M, int64_t Kp, int64_t G,
                                const uint8_t *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                                void *y, int y_bf16, int64_t ldy) {
    static __thread uint8_t *stage;              /* B rows of two groups, two blocks each: 4 x G x 16 bytes */
    static __thread float *acc;                  /* y, yz per row and block: M x 2 x 32 floats */
    static __thread int8_t *xpad;                /* beyond 32 rows, xq with its rows padded to a multiple of 32 */
    static __thread size_t stage_bytes, acc_bytes, xpad_bytes;   /* (all three grow, and are kept) */
    static __thread int32_t cbuf[2 * 2 * 32 * 16] __attribute__((aligned(64)));   /* two jobs' C: [2][b][32][16] */
    if (!int4_amx_granted()) return -2;
    if (M <= 0) return 0;
    const int64_t Mp = M <= 32 ? M : (M + 31) / 32 * 32;
    if (grow((void **)&stage, &stage_bytes, (size_t)(4 * G * 16)) || grow((void **)&acc, &acc_bytes, (size_t)M * 64 * 4)
        || (Mp > 32 && grow((void **)&xpad, &xpad_bytes, (size_t)(Mp * Kp))))
        return -1;
    if (Mp > 32) {                               /* every chunk 32 rows: one tile configuration */
        memcpy(xpad, xq, (size_t)(M * Kp));
        memset(xpad + M * Kp, 0, (size_t)((Mp - M) * Kp));
        xq = xpad;
    }
    const int64_t Gs = Kp / G, ws = 16 * (Kp / 2), sstride = 16 * Gs, pf = int4_lead();
    const int ks = G % 64 == 0 ? 64 : 32, two = Mp > 16;
    int4_amx_config(Mp < 16 ? (int)Mp : 16, Mp > 32 ? 16 : (int)(Mp - 16 > 0 ? Mp - 16 : 0), ks);
    for (int64_t nb = 0; nb < Np && nb < n_valid; nb += 32) {
        const int nbl = nb + 16 < Np && nb + 16 < n_valid ? 2 : 1;
        const uint8_t *wb = wq + nb * (Kp / 2);
        const float *sb = sc + nb * Gs, *zb = zc + nb * Gs;
        memset(acc, 0, (size_t)M * 64 * sizeof(float));
        int64_t prev_m0 = -1, prev_g = 0;       /* the job whose float steps are still to run */
        int buf = 0;
        int4_unpack(wb, ws, nbl, 0, G, pf, stage);
        for (int64_t g = 0; g < Gs; g++) {
            const uint8_t *bg = stage + (g & 1) * 2 * G * 16;   /* written a group ago: its stores have landed */
            if (g + 1 < Gs) int4_unpack(wb, ws, nbl, g + 1, G, pf, stage + ((g + 1) & 1) * 2 * G * 16);
            for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                int4_amx_job(xq + m0 * Kp + g * G, Kp, G, ks, bg, nbl, two, cbuf + buf * 1024);
                if (prev_m0 >= 0)                /* the last job's float steps while this one's tiles run */
                    int4_amx_epilogue(cbuf + (buf ^ 1) * 1024, prev_m0, M - prev_m0 < 32 ? M - prev_m0 : 32, nbl, sx,
                                      sxs, Gs, prev_g, sb, zb, sstride, acc);
                prev_m0 = m0, prev_g = g, buf ^= 1;
            }
        }
        int4_amx_epilogue(cbuf + (buf ^ 1) * 1024, prev_m0, M - prev_m0 < 32 ? M - prev_m0 : 32, nbl, sx, sxs, Gs,
                          prev_g, sb, zb, sstride, acc);
        for (int b = 0; b < nbl; b++) {
            const int64_t cnt = n_valid - nb - 16 * b < 16 ? n_valid - nb - 16 * b : 16;
            const __mmask16 mask = (__mmask16)((1u << cnt) - 1);
            for (int64_t i = 0; i < M; i++) {
                const float *a = acc + (i * 2 + b) * 32;
                store16(y, y_bf16, i * ldy + nb + 16 * b, mask, _mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + 16)));
            }
        }
    }
    _tile_release();
    return 0;
}
