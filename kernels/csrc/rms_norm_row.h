/*
 * One row of RMSNorm, after the residual add (float32), shared by rms_norm_cpu.c and
 * decoder_cpu.c; rms_norm_cpu.c's header says why:
 *
 *   residual += addend                     (when addend is not NULL)
 *   out = residual * weight / sqrt(mean(residual^2) + eps)
 *
 * In two parts, so that a row's values can be normed by several threads (decoder_cpu.c): the
 * row's sum of squares, which each of them takes in full, then any range of its values.
 */
#ifndef TOLLWAY_RMS_NORM_ROW_H
#define TOLLWAY_RMS_NORM_ROW_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* sum((residual + addend)^2), or sum(residual^2) when addend is NULL. Never inlined, so that
   every caller sums in the same order: the same bits in each library and on each thread. */
__attribute__((noinline)) static float norm_sum_of_squares(const float *restrict residual,
                                                           const float *restrict addend,
                                                           int64_t hidden) {
    float sum = 0.0f;
    if (addend != NULL) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
            const float x = residual[i] + addend[i];
            sum += x * x;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += residual[i] * residual[i];
    }
    return sum;
}

static inline float norm_inv_rms(float sum, int64_t hidden, float eps) {
    return 1.0f / sqrtf(sum / (float)hidden + eps);
}

/* Values [first, last) of a row: sum = residual (+ addend), out = sum * inv_rms * weight. sum
   may be residual itself (the add in place). */
static inline void norm_values(float *restrict out, float *sum, const float *residual,
                               const float *addend, const float *restrict weight,
                               int64_t first, int64_t last, float inv_rms) {
    if (addend != NULL) {
#pragma omp simd
        for (int64_t i = first; i < last; ++i) {
            const float x = residual[i] + addend[i];
            sum[i] = x;
            out[i] = x * inv_rms * weight[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = first; i < last; ++i) {
            const float x = residual[i];
            sum[i] = x;
            out[i] = x * inv_rms * weight[i];
        }
    }
}

static void norm_row(float *restrict out, float *residual, const float *addend,
                     const float *restrict weight, int64_t hidden, float eps) {
    const float inv_rms = norm_inv_rms(norm_sum_of_squares(residual, addend, hidden), hidden, eps);
    norm_values(out, residual, residual, addend, weight, 0, hidden, inv_rms);
}

#endif
