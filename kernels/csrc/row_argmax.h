/*
 * A row's argmax shared among threads, by NumPy's rule (the sampler's greedy choice,
 * worker/sampler.py's argmax_rows): the first largest value, or the first NaN. Each thread
 * takes its own share of the row (best_in), and the shares are then combined in order
 * (argmax_of_shares), so the index does not depend on how many threads there are.
 */
#ifndef TOLLWAY_ROW_ARGMAX_H
#define TOLLWAY_ROW_ARGMAX_H

#include <stdint.h>

/* A row's largest value in [first, last) and its first index, or its first NaN (NumPy's
   argmax); index -1 for an empty range. */
typedef struct {
    float value;
    int64_t index;
    int is_nan;
} RowBest;

__attribute__((optimize("no-fast-math"))) static RowBest best_in(const float *row,
                                                                 int64_t first, int64_t last) {
    RowBest best = {0.0f, -1, 0};
    for (int64_t i = first; i < last; ++i) {
        const float v = row[i];
        if (v != v) {
            const RowBest nan = {v, i, 1};
            return nan;
        }
        if (best.index < 0 || v > best.value) best.value = v, best.index = i;
    }
    return best;
}

/* The row's argmax from its team's shares, in order: the first NaN, else the first of the
   largest (a later share wins only if strictly larger). */
__attribute__((optimize("no-fast-math"))) static int64_t argmax_of_shares(const RowBest *shares,
                                                                          int64_t stride,
                                                                          int team) {
    RowBest best = {0.0f, -1, 0};
    for (int t = 0; t < team; ++t) {
        const RowBest share = shares[t * stride];
        if (share.index < 0) continue;
        if (share.is_nan) return share.index;
        if (best.index < 0 || share.value > best.value) best = share;
    }
    return best.index;
}

#endif
