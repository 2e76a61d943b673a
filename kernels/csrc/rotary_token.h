/*
 * Rotary position embedding of one token's heads, in place (float32), shared by
 * rotary_cpu.c and decoder_cpu.c; rotary_cpu.c's header says why. In each head, pair
 * (x[i], x[i + d/2]) turns by its angle (Hugging Face's rotate_half convention):
 *
 *   x[i]       <- x[i] * cos[i] - x[i + d/2] * sin[i]
 *   x[i + d/2] <- x[i + d/2] * cos[i] + x[i] * sin[i]        for i < d/2
 *
 * Built without contracting a*b - c*d into a fused multiply-add, so the result is the same
 * float32 arithmetic as the PyTorch path, bit for bit.
 */
#ifndef TOLLWAY_ROTARY_TOKEN_H
#define TOLLWAY_ROTARY_TOKEN_H

#include <stdint.h>

__attribute__((optimize("fp-contract=off", "no-fast-math"))) static void rotate_token(
    float *restrict x, const float *restrict cos, const float *restrict sin, int64_t heads,
    int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float *restrict first = x + h * head_dim;
        float *restrict second = first + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = first[i], b = second[i];
            first[i] = a * cos[i] - b * sin[i];
            second[i] = b * cos[i] + a * sin[i];
        }
    }
}

#endif
