/* One row's temperature / top-k draw for multi-step decoding (decode_stack.c: pd_decode_graph_steps), the
 * C twin of model/sampling.py's temperature_draw given the row's Gumbel noise. Included by decode_stack.c
 * only; kernels/cpu/__init__.py keys its build cache on this header too. */
#ifndef PD_SAMPLE_ROW_H
#define PD_SAMPLE_ROW_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> int32 key ordered as the floats are, every NaN above +inf (torch.topk's order). */
static inline int32_t order_key(float f) {
    if (f != f) return INT32_MAX;
    int32_t b;
    memcpy(&b, &f, 4);
    return b >= 0 ? b : b ^ INT32_MAX;
}

/* The k-th largest of keys[0, n) (1 <= k <= n; keys reordered): quickselect, median-of-three pivots. */
static int32_t kth_largest(int32_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;            /* index `want` in descending order */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        int32_t a = keys[lo], b = keys[mid], c = keys[hi];
        const int32_t pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {                                  /* descending: larger keys to the left */
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) { const int32_t t = keys[i]; keys[i] = keys[j]; keys[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return keys[want];
    }
    return keys[want];
}

/* model/sampling.py: temperature_draw for one row: scaled = x / t; for 0 < top_k < n, entries below the
 * k-th largest scaled are -inf; argmax_j (scaled_j - g[j]) with torch.argmax's index: the first NaN,
 * else the first maximum (0 for a row of -inf). scratch: room for n floats and n int32. */
static int64_t temperature_argmax(const float *x, const float *g, int64_t n, float t, int64_t top_k, void *scratch) {
    float *scaled = scratch;
    for (int64_t j = 0; j < n; j++) scaled[j] = x[j] / t;
    float kth = -INFINITY;
    if (top_k > 0 && top_k < n) {
        int32_t *keys = (int32_t *)(scaled + n), key;
        for (int64_t j = 0; j < n; j++) keys[j] = order_key(scaled[j]);
        key = kth_largest(keys, n, top_k);
        if (key == INT32_MAX) kth = NAN;                  /* a NaN among the top k: nothing is below it */
        else {
            const int32_t b = key >= 0 ? key : key ^ INT32_MAX;
            memcpy(&kth, &b, 4);
        }
    }
    int64_t best = 0;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float v = (scaled[j] < kth ? -INFINITY : scaled[j]) - g[j];
        if (v != v) return j;
        if (v > m) m = v, best = j;
    }
    return best;
}

#endif
