/* The CPU family, where a kernel's stream plan differs between AMD generations: GCC 12's
 * __builtin_cpu_is knows "amdfam19h" (Zen 3, Zen 4) but not "amdfam1ah" (Zen 5). Included by the
 * gemv sources (gemv_bf16.c, gemv_int4.c). */
#ifndef PD_CPU_FAMILY_H
#define PD_CPU_FAMILY_H
#include <cpuid.h>

/* The family of an AMD CPU (base + extended family from CPUID leaf 1: 0x19 Zen 3/4, 0x1A Zen 5), 0 for
 * other vendors. */
static inline int amd_family(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != signature_AMD_ebx || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xF;
    return (int)(base == 0xF ? base + ((a >> 20) & 0xFF) : base);
}

#endif
