/*
 * Paged decode attention for the CPU, reading KV blocks in place.
 *
 * The PyTorch reference gathers every sequence's blocks into a fresh contiguous tensor and
 * then runs SDPA: the cache is read, written and read again. This kernel walks each
 * sequence's block table and reads every key and value exactly once, so a decode step's
 * attention costs one pass over the context's KV bytes.
 *
 * Layout (see kernels/reference.py), all of one dtype, float32 or bfloat16:
 *   q, out:                 [num_seqs, num_heads, head_dim]
 *                           (q's rows may be strided: q_row_stride elements apart)
 *   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables:           [num_seqs, max_blocks] int32
 *   seq_lens:               [num_seqs] int32, context length incl. the query token
 *
 * Query head i reads KV head i / group (Hugging Face's repeat_kv order), so the group's
 * queries are consecutive and share each key and value load. Work items are whole
 * sequences (or, with fewer sequences than 2 per thread, (sequence, KV head) pairs), spread
 * over OpenMP threads; with PyTorch loaded first the process has one OpenMP runtime
 * (PyTorch's libgomp.so.1), shared with its own ops.
 *
 * Per item: pass 1 computes every query row's scores for the whole context into a
 * per-thread buffer, then the softmax, then pass 2 accumulates the values. Both passes go
 * block by block (each key and value read from memory once) and, inside a block, query row
 * by query row: the row's query (pass 1) or its output sums (pass 2) stay in vector
 * registers across the block's tokens, whose rows the other query rows of the group then
 * find in L1. Head sizes 64 and 128 get unrolled code (GCC/Clang vector extensions, 16
 * floats a register: AVX-512, or two AVX2 / four NEON registers); others a plain loop. Pass
 * 1 scores sixteen keys at a time and reduces their sixteen partial-sum vectors together
 * (a shuffle tree), not each on its own: 1.13-1.16x on the whole kernel.
 * The block two ahead is prefetched in slices between query rows: blocks lie anywhere in
 * the cache, so the hardware prefetcher loses the stream at each block boundary. The
 * scores buffer is rows * max_len floats, small enough to stay in L2. Arithmetic is
 * float32 whatever the dtype, as in the reference: a bfloat16 block is widened (exactly)
 * into a per-thread buffer as it is read, so bfloat16 caches cost half the memory traffic,
 * and the output is rounded to nearest even once at the end.
 *
 * The same library holds store_kv (at the end): the new tokens' key and value rows copied
 * into their slots.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

#define TOLLWAY_ABI_VERSION 5

int tollway_abi_version(void) { return TOLLWAY_ABI_VERSION; }

/*
 * dtype: DTYPE_FLOAT32 or DTYPE_BFLOAT16, for q, the caches and out alike.
 * Returns 0 on success, -1 if a work buffer could not be allocated, -2 if a block table
 * is too short for its sequence or names a block outside the cache (nothing is read then).
 */
int tollway_paged_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                                   const int32_t *block_tables, const int32_t *seq_lens,
                                   void *out, int dtype, int64_t q_row_stride, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                   float scale, int num_threads) {
    if (!tables_are_valid(block_tables, seq_lens, num_seqs, num_blocks, block_size, max_blocks))
        return -2;
    const AttentionItems items =
        attention_items(seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                        max_blocks, scale, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buffer = malloc(attention_buffer_floats(&items) * sizeof(float));
        if (buffer == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items.items_per_seq; ++item)
            if (buffer != NULL)
                attend_item(&items, item, q, q_row_stride, key_cache, value_cache, dtype,
                            block_tables, seq_lens, out, buffer);
        free(buffer);
    }
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
