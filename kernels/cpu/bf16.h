/* bf16 <-> float32 conversions shared by the CPU kernels (included; kernels/cpu/__init__.py keys its
 * build cache on this header too). bf16 is the upper half of a float32: widening is exact; narrowing
 * rounds to nearest even, as torch's .to(torch.bfloat16) does, and keeps NaN a quiet NaN. */
#ifndef PD_BF16_H
#define PD_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
