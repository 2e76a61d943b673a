/*
 * Paged decode attention for the CPU, reading KV blocks in place.
 *
 * The PyTorch reference gathers every sequence's blocks into a fresh contiguous tensor and
 * then runs SDPA: the cache is read, written and read again. This kernel walks each
 * sequence's block table and reads every key and value exactly once, so a decode step's
 * attention costs one pass over the context's KV bytes.
 *
 * Layout (see kernels/reference.py), q, out and the caches of one dtype, float32 or
 * bfloat16, or int8 caches with float32 or bfloat16 q and out:
 *   q, out:                 [num_seqs, num_heads, head_dim]
 *                           (q's rows may be strided: q_row_stride elements apart)
 *   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
 *                           (int8: [num_blocks, block_size + 1, ...], the last row of each
 *                           block its float32 scales; kernels/int8_kv_cache.py)
 *   block_tables:           [num_seqs, max_blocks] int32
 *   seq_lens:               [num_seqs] int32, context length incl. the query token
 *
 * Query head i reads KV head i / group (Hugging Face's repeat_kv order), so the group's
 * queries are consecutive and share each key and value load. A context is cut into
 * partitions of whole blocks, combined as flash decoding does (paged_attention.h); work items
 * are whole sequences (or, with fewer sequences than 2 per thread, single partitions, then a
 * pass that combines them), spread over OpenMP threads; with PyTorch loaded first the
 * process has one OpenMP runtime (PyTorch's libgomp.so.1), shared with its own ops.
 *
 * Per partition: pass 1 computes every query row's scores for its tokens into a
 * per-thread buffer, then the exponentials, then pass 2 accumulates the values. Both passes go
 * block by block (each key and value read from memory once) and, inside a block, query row
 * by query row: the row's query (pass 1) or its output sums (pass 2) stay in vector
 * registers across the block's tokens, whose rows the other query rows of the group then
 * find in L1. Head sizes 64 and 128 get unrolled code (GCC/Clang vector extensions, 16
 * floats a register: AVX-512, or two AVX2 / four NEON registers); others a plain loop. Pass
 * 1 scores sixteen keys at a time and reduces their sixteen partial-sum vectors together
 * (a shuffle tree), not each on its own: 1.13-1.16x on the whole kernel.
 * The block two ahead is prefetched in slices between query rows: blocks lie anywhere in
 * the cache, so the hardware prefetcher loses the stream at each block boundary. The
 * scores buffer is rows * the longest partition's tokens, small enough to stay in L2. Arithmetic is
 * float32 whatever the dtype, as in the reference: a bfloat16 block is widened (exactly)
 * into a per-thread buffer as it is read, so bfloat16 caches cost half the memory traffic,
 * and the output is rounded to nearest even once at the end. An int8 block is widened the
 * same way, each value times its head's scale: a quarter of float32's memory traffic.
 *
 * The same library holds store_kv (at the end): the new tokens' key and value rows copied
 * into their slots, or quantized into an int8 cache's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

#define TOLLWAY_ABI_VERSION 6

int tollway_abi_version(void) { return TOLLWAY_ABI_VERSION; }

/*
 * dtype: DTYPE_FLOAT32 or DTYPE_BFLOAT16, for q and out; cache_dtype: the same, or DTYPE_INT8.
 * Returns 0 on success, -1 if a work buffer could not be allocated, -2 if a block table
 * is too short for its sequence or names a block outside the cache (nothing is read then).
 */
int tollway_paged_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                                   const int32_t *block_tables, const int32_t *seq_lens,
                                   void *out, int dtype, int cache_dtype, int64_t q_row_stride,
                                   int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                   float scale, int num_threads) {
    if (!tables_are_valid(block_tables, seq_lens, num_seqs, num_blocks, block_size, max_blocks))
        return -2;
    const AttentionItems items =
        attention_items(seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                        max_blocks, scale, num_threads);
    float *partials = malloc(attention_partial_floats(&items, num_seqs) * sizeof(float) + 1);
    if (partials == NULL) return -1;
    int failed = 0; /* shared: a thread could not allocate its buffer */
#pragma omp parallel num_threads(num_threads)
    {
        float *buffer = malloc(attention_buffer_floats(&items) * sizeof(float));
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items.items_per_seq; ++item)
            if (buffer != NULL)
                attend_item_caches(&items, item, q, q_row_stride, key_cache, value_cache, dtype,
                                   cache_dtype, block_tables, seq_lens, partials, out, buffer);
        free(buffer);
        int any_failed; /* the same for every thread, read after the loop's barrier */
#pragma omp atomic read
        any_failed = failed;
        if (!any_failed && items.split) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < num_seqs * num_heads; ++item)
                combine_item(&items, item, seq_lens, partials, dtype, out);
        }
    }
    free(partials);
    return failed ? -1 : 0;
}

/*
 * store_kv: copy each new token's key and value rows into their cache slots.
 *
 *   key, value:             [tokens, num_kv_heads * head_dim] rows, row_stride elements apart
 *                           (views into the q/k/v projection), the caches' dtype
 *   key_cache, value_cache: [num_slots, num_kv_heads * head_dim] (blocks x block_size slots)
 *   slots:                  [tokens] int64; negative (-1) = do not store
 *
 * Returns 0, or -2 (nothing written) if a slot lies outside the cache.
 */
int tollway_store_kv(const void *key, const void *value, void *key_cache, void *value_cache,
                     const int64_t *slots, int dtype, int64_t tokens, int64_t row_stride,
                     int64_t width, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= num_slots) return -2;
    const size_t size = element_size(dtype);
    const size_t row_bytes = (size_t)width * size;
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        const size_t from = (size_t)(t * row_stride) * size, to = (size_t)slots[t] * row_bytes;
        memcpy((char *)key_cache + to, (const char *)key + from, row_bytes);
        memcpy((char *)value_cache + to, (const char *)value + from, row_bytes);
    }
    return 0;
}

/*
 * store_kv into int8 caches [num_blocks, block_size + 1, num_kv_heads, head_dim]: each new
 * token quantized into its slot, in token order (store_token_int8).
 *
 *   key, value: [tokens, num_kv_heads * head_dim] rows, row_stride elements apart, of dtype
 *               (DTYPE_FLOAT32 or DTYPE_BFLOAT16)
 *   slots:      [tokens] int64; negative (-1) = do not store
 *
 * Returns 0, -1 if a work buffer could not be allocated, or -2 (nothing written) if a slot
 * lies outside the cache.
 */
int tollway_store_kv_int8(const void *key, const void *value, int8_t *key_cache,
                          int8_t *value_cache, const int64_t *slots, int dtype, int64_t tokens,
                          int64_t row_stride, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= num_slots) return -2;
    const int64_t width = num_kv_heads * head_dim;
    float *widened = NULL;
    if (dtype != DTYPE_FLOAT32) {
        widened = malloc((size_t)(2 * width) * sizeof(float));
        if (widened == NULL) return -1;
    }
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        const float *k, *v;
        if (widened == NULL) {
            k = (const float *)key + t * row_stride;
            v = (const float *)value + t * row_stride;
        } else {
            const uint16_t *k16 = (const uint16_t *)key + t * row_stride;
            const uint16_t *v16 = (const uint16_t *)value + t * row_stride;
            for (int64_t e = 0; e < width; ++e) {
                widened[e] = f32_of_bf16(k16[e]);
                widened[width + e] = f32_of_bf16(v16[e]);
            }
            k = widened;
            v = widened + width;
        }
        store_token_int8(key_cache, value_cache, slots[t], k, v, num_kv_heads, head_dim,
                         block_size);
    }
    free(widened);
    return 0;
}
