/*
 * One row of RMSNorm, after the residual add (float32), shared by rms_norm_cpu.c and
 * decoder_cpu.c; rms_norm_cpu.c's header says why:
 *
 *   residual += addend                     (when addend is not NULL)
 *   out = residual * weight / sqrt(mean(residual^2) + eps)
 */
#ifndef TOLLWAY_RMS_NORM_ROW_H
#define TOLLWAY_RMS_NORM_ROW_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

static void norm_row(float *restrict out, float *restrict residual, const float *restrict addend,
                     const float *restrict weight, int64_t hidden, float eps) {
    float sum = 0.0f;
    if (addend != NULL) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
            const float x = residual[i] + addend[i];
            residual[i] = x;
            sum += x * x;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += residual[i] * residual[i];
    }
    const float inv_rms = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) out[i] = residual[i] * inv_rms * weight[i];
}

#endif
