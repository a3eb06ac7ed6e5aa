/* pd_int4_gemv, the entry point both INT4 libraries export (gemv_int4.c on AVX512-VNNI,
 * gemv_int4_avx2.c on AVX2): included at the end of each, after its pd_int4_quantize_rows and
 * pd_int4_gemv_q. kernels/cpu/__init__.py keys its build cache on this header too. */
#ifndef PD_INT4_GEMV_H
#define PD_INT4_GEMV_H
#include <stdint.h>
#include <stdlib.h>

/* x [M, K] (bf16 if x_bf16 else fp32, row stride ldx) quantized by pd_int4_quantize_rows into per-thread
 * scratch (grown, kept): *xq [M, Kp], *sx and *sxs [M, Kp / G]. Returns 0, or -1 if it could not be allocated. */
static int int4_quantized(const void *x, int x_bf16, int64_t M, int64_t K, int64_t ldx, int64_t Kp, int64_t G,
                          int8_t **xq, float **sx, float **sxs) {
    static __thread char *scratch;
    static __thread size_t cap;
    const int64_t Gs = Kp / G;
    const size_t need = (size_t)(M * Kp + 2 * M * Gs * (int64_t)sizeof(float) + 64);
    if (need > cap) {
        char *p = realloc(scratch, need);
        if (!p) return -1;
        scratch = p; cap = need;
    }
    *sx = (float *)scratch;
    *sxs = *sx + M * Gs;
    *xq = (int8_t *)(*sxs + M * Gs);
    pd_int4_quantize_rows(x, x_bf16, M, K, ldx, G, Kp, *xq, *sx, *sxs);
    return 0;
}

/* Both steps: quantize x [M, K] (bf16 if x_bf16 else fp32, row stride ldx) then multiply. Returns 0, or -1
 * if the scratch could not be allocated. */
int pd_int4_gemv(const void *x, int x_bf16, int64_t M, int64_t K, int64_t ldx, int64_t Kp, int64_t G,
                 const uint8_t *wq, const float *sc, const float *zc, int64_t Np, int64_t n_valid,
                 void *y, int y_bf16, int64_t ldy) {
    int8_t *xq;
    float *sx, *sxs;
    if (int4_quantized(x, x_bf16, M, K, ldx, Kp, G, &xq, &sx, &sxs)) return -1;
    pd_int4_gemv_q(xq, sx, sxs, M, Kp, G, wq, sc, zc, Np, n_valid, y, y_bf16, ldy);
    return 0;
}
#endif
