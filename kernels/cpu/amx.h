/* What the AMX kernels share (gemm_amx.h in gemv_bf16.c, prefill_attention_amx.c): their target
 * attribute, the tile configuration (palette 1, 64-byte rows) and the check that this process may use tile
 * data (Linux grants it on request: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA). */
#ifndef PD_AMX_H
#define PD_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;

/* 1 if the kernel lets this process use tile data (asks for it; on an AMX CPU). */
static inline int amx_tile_data_granted(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* 1 if AMX-BF16 (and AVX512-BF16) is present and the kernel lets this process use tile data. */
static inline int amx_bf16_granted(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return 0;
    return amx_tile_data_granted();
}

/* Loads the tile configuration: every tile 64 bytes wide, rows[t] rows in tile t. */
AMX static inline void amx_config(const uint8_t rows[8]) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = rows[t]; }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg, so at -O2 the stores above
     * can be dropped as dead (every tile then faults): the barrier makes them land first. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif
