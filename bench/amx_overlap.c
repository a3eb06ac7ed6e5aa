/* What an AMX core overlaps: tile loads from L1 and L2 with and without a product after each, and
 * independent 512-bit / 256-bit FMAs alone and beside a tdpbf16ps (16 x 16 x 32 bf16). Best of 5 passes of
 * 2M iterations each, ns per iteration. Behind docs/benchmarks.md, "On the Xeon model 207 with AMX again":
 * a load from L1 hides under a product, one from L2 does not, and zmm FMAs run at about half rate while a
 * product executes. Not run in CI; needs AMX-BF16.
 *
 *   gcc -O2 -mavx512f -mfma -o /tmp/amx_overlap bench/amx_overlap.c
 *   taskset -c 1 /tmp/amx_overlap
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../kernels/cpu/amx.h"

#define ITERS 2000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Tile loads of 1 KiB (16 rows, `stride` bytes apart) walking a `bytes` buffer; with a product after each. */
AMX static double loads(size_t bytes, int stride, int product) {
    uint8_t *buf = aligned_alloc(4096, bytes);
    memset(buf, 1, bytes);
    const size_t tiles = bytes / (16 * (size_t)stride) ? bytes / (16 * (size_t)stride) : 1;
    double best = 1e9;
    for (int pass = 0; pass < 5; pass++) {
        const double t0 = now();
        for (long i = 0; i < ITERS; i++) {
            _tile_loadd(2, buf + (i % tiles) * 16 * stride, stride);
            if (product) _tile_dpbf16ps(0, 2, 3);
        }
        const double t = (now() - t0) / ITERS * 1e9;
        best = t < best ? t : best;
    }
    free(buf);
    return best;
}

/* k x 8 independent FMAs (zmm, or ymm when `narrow`), after a product when `product`. */
#define FMA8(T, F) a0 = F(a0, b, c); a1 = F(a1, b, c); a2 = F(a2, b, c); a3 = F(a3, b, c); \
                   a4 = F(a4, b, c); a5 = F(a5, b, c); a6 = F(a6, b, c); a7 = F(a7, b, c);
#define FMA_LOOP(T, SET, F)                                                                       \
    T a0 = SET(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;             \
    const T b = SET(0.999f), c = SET(0.001f);                                                     \
    for (int pass = 0; pass < 5; pass++) {                                                        \
        const double t0 = now();                                                                  \
        for (long i = 0; i < ITERS; i++) {                                                        \
            if (product) _tile_dpbf16ps(0, 2, 3);                                                 \
            for (int j = 0; j < k; j++) { FMA8(T, F) }                                            \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),   \
                             "+v"(a6), "+v"(a7));                                                 \
        }                                                                                         \
        const double t = (now() - t0) / ITERS * 1e9;                                              \
        best = t < best ? t : best;                                                               \
    }

AMX static double fmas(int k, int product, int narrow) {
    double best = 1e9;
    if (narrow) {
        FMA_LOOP(__m256, _mm256_set1_ps, _mm256_fmadd_ps)
    } else {
        FMA_LOOP(__m512, _mm512_set1_ps, _mm512_fmadd_ps)
    }
    return best;
}

AMX static void run(void) {
    amx_config((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
    _tile_zero(0); _tile_zero(2); _tile_zero(3);
    printf("tile load, L1 (16 KiB), 64-byte rows:          %6.2f ns\n", loads(16384, 64, 0));
    printf("tile load, L2 (256 KiB), 64-byte rows:         %6.2f ns\n", loads(262144, 64, 0));
    printf("tile load, L2 (256 KiB), 128-byte row stride:  %6.2f ns\n", loads(262144, 128, 0));
    printf("tile load + product, L1:                       %6.2f ns\n", loads(16384, 128, 1));
    printf("tile load + product, L2, 128-byte stride:      %6.2f ns\n", loads(262144, 128, 1));
    printf("product alone:                                 %6.2f ns\n", fmas(0, 1, 0));
    for (int k = 1; k <= 4; k *= 4) {
        printf("%2d zmm FMAs alone / beside a product:         %6.2f / %6.2f ns\n", 8 * k, fmas(k, 0, 0),
               fmas(k, 1, 0));
        printf("%2d ymm FMAs alone / beside a product:         %6.2f / %6.2f ns\n", 8 * k, fmas(k, 0, 1),
               fmas(k, 1, 1));
    }
    _tile_release();
}

int main(void) {
    if (!amx_bf16_granted()) {
        fprintf(stderr, "no AMX-BF16 here (or the kernel refused tile data)\n");
        return 1;
    }
    run();
    return 0;
}
