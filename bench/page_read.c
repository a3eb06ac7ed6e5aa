/* How fast one core reads a KV cache's pages: 56 MB as pages of PAGE KiB spaced STRIDE KiB apart (the
 * block-major cache puts each layer's 16 KiB of a block 192 KiB, one block of 12 layers, from the next
 * block's), in order or shuffled, with a software prefetch scheme per mode; best of 5 passes, the L3
 * evicted before each. The limit decode attention meets at batch 32 (docs/benchmarks.md, Zen 5 fourth
 * session). Not run in CI.
 *
 *   gcc -O2 -mavx512f -mavx512bw -o /tmp/page_read bench/page_read.c
 *   taskset -c 1 /tmp/page_read [PAGE_KiB=16] [STRIDE_KiB=192] [shuffle=1]
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const size_t page = (argc > 1 ? (size_t)atoi(argv[1]) : 16) * 1024;
    const size_t stride = (argc > 2 ? (size_t)atoi(argv[2]) : 192) * 1024;
    const int shuffle = argc > 3 ? atoi(argv[3]) : 1;
    const size_t n = 56u * 1024 * 1024 / page, total = n * stride, evict = 256u << 20;
    char *buf = mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *ev = malloc(evict);
    int *perm = malloc(n * sizeof(int));
    if (buf == MAP_FAILED || !ev || !perm) return 1;
    madvise(buf, total, MADV_HUGEPAGE);
    memset(buf, 1, total);
    memset(ev, 2, evict);
    for (size_t i = 0; i < n; i++) perm[i] = (int)i;
    srand(1);
    for (size_t i = n - 1; shuffle && i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const int t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    const size_t off = stride > page ? page : 0;   /* a layer's slice inside the block, as layer 1 */
#define PG(i) (buf + (size_t)perm[(i) < n ? (i) : n - 1] * stride + off)
    const char *names[] = {"no software prefetch", "next page, T1, spread", "next page, T0, spread",
                           "next and next-but-one, T1, spread", "next page, NTA, spread",
                           "next T0 + next-but-one T1, spread", "three pages ahead, T1, spread"};
    for (int mode = 0; mode < 7; mode++) {
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            volatile long sink = 0;
            for (size_t i = 0; i < evict; i += 64) sink += ev[i];
            __m512i acc = _mm512_setzero_si512();
            const double t0 = now();
            for (size_t i = 0; i < n; i++) {
                const char *pg = PG(i), *n1 = PG(i + 1), *n2 = PG(i + 2), *n3 = PG(i + 3);
                for (size_t o = 0; o < page; o += 64) {
                    switch (mode) {
                    case 1: _mm_prefetch(n1 + o, _MM_HINT_T1); break;
                    case 2: _mm_prefetch(n1 + o, _MM_HINT_T0); break;
                    case 3: _mm_prefetch(n1 + o, _MM_HINT_T1); _mm_prefetch(n2 + o, _MM_HINT_T1); break;
                    case 4: _mm_prefetch(n1 + o, _MM_HINT_NTA); break;
                    case 5: _mm_prefetch(n1 + o, _MM_HINT_T0); _mm_prefetch(n2 + o, _MM_HINT_T1); break;
                    case 6: _mm_prefetch(n3 + o, _MM_HINT_T1); break;
                    default: break;
                    }
                    acc = _mm512_add_epi32(acc, _mm512_loadu_si512(pg + o));
                }
            }
            const double t = now() - t0;
            best = t < best ? t : best;
            sink += _mm512_reduce_add_epi32(acc);
        }
        printf("%-36s %7.3f ms  %5.1f GB/s\n", names[mode], best * 1e3, n * page / best / 1e9);
    }
    return 0;
}
