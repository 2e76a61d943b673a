/*
 * Rotary position embedding, applied in place (float32), Hugging Face's rotate_half
 * convention (rotary_token.h has the formula and the per-token code), with cos/sin looked
 * up per token. The PyTorch path (chunk, four products, two sums, a concatenation into a
 * new tensor) is eight passes and allocations per layer; this is one pass over the query
 * and key heads, where the q/k/v projection left them, bit for bit the same arithmetic.
 *
 *   x:        [tokens, heads, head_dim]; heads and head_dim contiguous, tokens x_stride apart
 *   cos, sin: [tokens, head_dim / 2]; contiguous rows, cs_stride apart
 */
#include <stdint.h>

#include "rotary_token.h"

#define TOLLWAY_ROTARY_ABI_VERSION 1
#define TOKENS_PER_THREAD 32 /* fewer tokens than this per thread: one thread does them all */

int tollway_rotary_abi_version(void) { return TOLLWAY_ROTARY_ABI_VERSION; }

void tollway_rotary_in_place(float *x, const float *cos, const float *sin, int64_t tokens,
                             int64_t heads, int64_t head_dim, int64_t x_stride, int64_t cs_stride,
                             int num_threads) {
    const int threads = tokens >= 2 * TOKENS_PER_THREAD ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tokens; ++t)
        rotate_token(x + t * x_stride, cos + t * cs_stride, sin + t * cs_stride, heads, head_dim);
}
