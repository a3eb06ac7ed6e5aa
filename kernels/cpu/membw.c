/* Streaming read bandwidth: the speed of light for a decode step, which reads every weight once.
 *
 * Each pass reads the whole buffer with vector loads into 8 independent accumulators (so the
 * loads, not an add chain, are the limit) and folds them into a checksum: the sum modulo 2^64 of
 * the buffer's little-endian 8-byte words, counted from the buffer's first byte, the last partial
 * word zero-extended. Every path returns the same checksum, which the caller can verify, so no
 * compiler can drop the reads. Paths (pd_membw_read's `path`):
 *
 *   0 scalar   1 AVX2   2 AVX-512   3 AVX-512 + prefetcht0   4 AVX-512 + prefetchnta
 *
 * The ISA paths use target attributes and are refused (-2) on a CPU without the ISA. With
 * `threads` > 1 the buffer is split into contiguous slices read concurrently (pthreads); the
 * time of a pass runs from the release of all threads to the last one finishing.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PREFETCH_BYTES 2048        /* prefetch distance ahead of the loads */

static uint64_t tail_sum(const uint8_t *p, int64_t n) {   /* words (last one partial) of n bytes */
    uint64_t s = 0, w;
    for (; n >= 8; p += 8, n -= 8) { memcpy(&w, p, 8); s += w; }
    if (n > 0) { w = 0; memcpy(&w, p, (size_t)n); s += w; }
    return s;
}

static uint64_t read_scalar(const uint8_t *p, int64_t n) {
    uint64_t a[8] = {0}, w;
    for (; n >= 64; p += 64, n -= 64)
        for (int j = 0; j < 8; j++) { memcpy(&w, p + 8 * j, 8); a[j] += w; }
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7] + tail_sum(p, n);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (; n >= 256; p += 256, n -= 256) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + 0)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + 96)));
        a4 = _mm256_add_epi64(a4, _mm256_loadu_si256((const __m256i *)(p + 128)));
        a5 = _mm256_add_epi64(a5, _mm256_loadu_si256((const __m256i *)(p + 160)));
        a6 = _mm256_add_epi64(a6, _mm256_loadu_si256((const __m256i *)(p + 192)));
        a7 = _mm256_add_epi64(a7, _mm256_loadu_si256((const __m256i *)(p + 224)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)),
                          _mm256_add_epi64(_mm256_add_epi64(a4, a5), _mm256_add_epi64(a6, a7)));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a0);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + tail_sum(p, n);
}

/* prefetch: 0 none, 1 prefetcht0, 2 prefetchnta, PREFETCH_BYTES ahead (a prefetch past the end never faults) */
__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t *p, int64_t n, int prefetch) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#define PD_BLOCK                                                                   \
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + 0)));     \
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + 64)));    \
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(p + 128)));   \
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(p + 192)));   \
        a4 = _mm512_add_epi64(a4, _mm512_loadu_si512((const void *)(p + 256)));   \
        a5 = _mm512_add_epi64(a5, _mm512_loadu_si512((const void *)(p + 320)));   \
        a6 = _mm512_add_epi64(a6, _mm512_loadu_si512((const void *)(p + 384)));   \
        a7 = _mm512_add_epi64(a7, _mm512_loadu_si512((const void *)(p + 448)));
    if (prefetch == 1) {
        for (; n >= 512; p += 512, n -= 512) {
            for (int j = 0; j < 512; j += 64) _mm_prefetch((const char *)(p + PREFETCH_BYTES + j), _MM_HINT_T0);
            PD_BLOCK
        }
    } else if (prefetch == 2) {
        for (; n >= 512; p += 512, n -= 512) {
            for (int j = 0; j < 512; j += 64) _mm_prefetch((const char *)(p + PREFETCH_BYTES + j), _MM_HINT_NTA);
            PD_BLOCK
        }
    } else {
        for (; n >= 512; p += 512, n -= 512) { PD_BLOCK }
    }
#undef PD_BLOCK
    a0 = _mm512_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)),
                          _mm512_add_epi64(_mm512_add_epi64(a4, a5), _mm512_add_epi64(a6, a7)));
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, a0);
    uint64_t s = 0;
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s + tail_sum(p, n);
}
#endif

/* Highest path this CPU runs: 2 (AVX-512F), 1 (AVX2) or 0 (scalar). */
int pd_membw_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
#endif
    return 0;
}

static int path_ok(int path) {
    if (path < 0 || path > 4) return 0;
    int isa = pd_membw_best_isa();
    return path == 0 || (path == 1 && isa >= 1) || (path >= 2 && isa >= 2);
}

static uint64_t read_path(const uint8_t *p, int64_t n, int path) {
#if defined(__x86_64__)
    if (path == 1) return read_avx2(p, n);
    if (path >= 2) return read_avx512(p, n, path - 2);
#endif
    return read_scalar(p, n);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    const uint8_t *p;
    int64_t n;                     /* this thread's slice; its first byte is 8-byte aligned in the buffer */
    int path;
    int64_t repeats;
    uint64_t sum;                  /* checksum of the slice (last pass) */
    atomic_long *go;               /* pass number released by the timing thread */
    atomic_long *done;             /* slices finished, summed over passes */
} slice_t;

static void *worker(void *arg) {
    slice_t *s = arg;
    for (int64_t r = 1; r <= s->repeats; r++) {
        while (atomic_load_explicit(s->go, memory_order_acquire) < r) { }
        s->sum = read_path(s->p, s->n, s->path);
        atomic_fetch_add_explicit(s->done, 1, memory_order_release);
    }
    return NULL;
}

#define MAX_THREADS 256

/* Read `nbytes` at `buf` `repeats` times with `path` on `threads` threads. Writes the fastest pass
 * in seconds to *best_seconds and the checksum (module comment) to *checksum. Returns 0, -1 for a
 * bad argument, -2 for a path this CPU lacks, -3 if a thread could not be started. */
int pd_membw_read(const uint8_t *buf, int64_t nbytes, int path, int64_t repeats, int64_t threads,
                  double *best_seconds, uint64_t *checksum) {
    if (nbytes < 0 || repeats < 1 || threads < 1 || threads > MAX_THREADS) return -1;
    if (!path_ok(path)) return -2;
    static slice_t slices[MAX_THREADS];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_t tids[MAX_THREADS];
    atomic_long go = 0, done = 0;
    pthread_mutex_lock(&lock);                 /* the slice table is shared: one measurement at a time */
    int64_t words = nbytes / 8, per = words / threads, start = 0;
    for (int64_t t = 0; t < threads; t++) {    /* 8-byte-aligned slices keep the word checksum additive */
        int64_t len = t == threads - 1 ? nbytes - start : per * 8;
        slices[t] = (slice_t){buf + start, len, path, repeats, 0, &go, &done};
        start += len;
    }
    int64_t started = 1, rc = 0;
    for (; started < threads; started++)
        if (pthread_create(&tids[started], NULL, worker, &slices[started])) { rc = -3; break; }
    double best = 1e300;
    for (int64_t r = 1; r <= repeats && rc == 0; r++) {
        double t0 = now();
        atomic_store_explicit(&go, r, memory_order_release);
        slices[0].sum = read_path(slices[0].p, slices[0].n, path);
        while (atomic_load_explicit(&done, memory_order_acquire) < (r - 1) * (threads - 1) + (threads - 1)) { }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    if (rc) atomic_store_explicit(&go, repeats, memory_order_release);   /* let started workers run out */
    for (int64_t t = 1; t < started; t++) pthread_join(tids[t], NULL);
    uint64_t sum = 0;
    for (int64_t t = 0; t < threads; t++) sum += slices[t].sum;
    pthread_mutex_unlock(&lock);
    if (rc) return (int)rc;
    *best_seconds = best;
    *checksum = sum;
    return 0;
}

/* The core's clock, measured: `iterations` x 64 register-to-register integer adds, each depending on
 * the one before (latency 1 cycle on every x86 core since the Pentium Pro), so the loop takes
 * iterations x 64 cycles whatever the reported frequency; the caller times it. The addend is a
 * register, not an immediate: Golden Cove and later fold chains of immediate adds at rename (an
 * Emerald Rapids core "ran" such a chain at 17.8 GHz). Under a hypervisor /proc/cpuinfo
 * often gives only the nominal clock, and a paper peak from it can fall below a measured rate.
 * Returns the chain's value (iterations x 64) so the loop cannot be dropped. */
int64_t pd_add_chain(int64_t iterations) {
    uint64_t x = 0, one = 1;
    for (int64_t i = 0; i < iterations; i++) {
#if defined(__x86_64__)
#define ADD8 "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
        __asm__ volatile(ADD8 ADD8 ADD8 ADD8 ADD8 ADD8 ADD8 ADD8 : "+r"(x) : "r"(one));
#undef ADD8
#else
        for (int j = 0; j < 64; j++) __asm__ volatile("" : "+r"(x)), x += 1;
#endif
    }
    return (int64_t)x;
}
