/*
 * Paged decode attention for the CPU, reading KV blocks in place.
 *
 * The PyTorch reference gathers every sequence's blocks into a fresh contiguous tensor and
 * then runs SDPA: the cache is read, written and read again. This kernel walks each
 * sequence's block table and reads every key and value exactly once, so a decode step's
 * attention costs one pass over the context's KV bytes.
 *
 * Layout (see kernels/reference.py):
 *   q, out:                 [num_seqs, num_heads, head_dim]               float32
 *                           (q's rows may be strided: q_row_stride elements apart)
 *   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] float32
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
 * per-thread buffer (keys read once, block by block, the next block prefetched), then the
 * softmax, then pass 2 accumulates the values (read once). The scores buffer is
 * rows * max_len floats, small enough to stay in L2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOLLWAY_ABI_VERSION 3

int tollway_abi_version(void) { return TOLLWAY_ABI_VERSION; }

/* Ask for the first cache line of each token's row of a block before it is needed. */
static inline void prefetch_block(const float *block, int64_t block_size, int64_t token_stride) {
    for (int64_t j = 0; j < block_size; ++j) __builtin_prefetch(block + j * token_stride, 0, 0);
}

/*
 * Attention of the query heads that read KV heads [first_kv_head, first_kv_head + num_kv)
 * of one sequence. Tokens are the outer loop, so when an item covers all KV heads each
 * token's keys (and values) are one contiguous run of bytes and a block is read front to
 * back; the next block is prefetched while the current one is processed.
 */
static void attend(const float *restrict q, /* this item's queries: [rows, head_dim] */
                   const float *restrict key_cache, const float *restrict value_cache,
                   const int32_t *restrict table, int64_t len, int64_t num_kv,
                   int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                   int64_t block_stride, int64_t head_offset, float scale,
                   float *restrict scores, /* [rows, len] */
                   float *restrict out /* [rows, head_dim] */) {
    const int64_t rows = num_kv * group;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    /* Pass 1: scores[r][t] = scale * q[r] . k[t] for query row r = kv * group + g */
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *k_block = key_cache + table[b] * block_stride + head_offset;
        if (b + 1 < num_blocks)
            prefetch_block(key_cache + table[b + 1] * block_stride + head_offset, block_size,
                           token_stride);
        for (int64_t j = 0; j < n; ++j) {
            const float *k_token = k_block + j * token_stride;
            for (int64_t r = 0; r < rows; ++r) {
                const float *k = k_token + (r / group) * head_dim;
                const float *qr = q + r * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * k[d];
                scores[r * len + start + j] = dot * scale;
            }
        }
    }
    /* Softmax over each query's row; rows of out start at zero. */
    for (int64_t r = 0; r < rows; ++r) {
        float *row = scores + r * len;
        float max_score = row[0];
        for (int64_t t = 1; t < len; ++t) max_score = row[t] > max_score ? row[t] : max_score;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
            row[t] = expf(row[t] - max_score);
            total += row[t];
        }
        const float inv_total = 1.0f / total;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv_total;
    }
    memset(out, 0, (size_t)(rows * head_dim) * sizeof(float));
    /* Pass 2: out[r] = sum_t p[r][t] * v[t] */
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *v_block = value_cache + table[b] * block_stride + head_offset;
        if (b + 1 < num_blocks)
            prefetch_block(value_cache + table[b + 1] * block_stride + head_offset, block_size,
                           token_stride);
        for (int64_t j = 0; j < n; ++j) {
            const float *v_token = v_block + j * token_stride;
            for (int64_t r = 0; r < rows; ++r) {
                const float *v = v_token + (r / group) * head_dim;
                const float p = scores[r * len + start + j];
                float *o = out + r * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] += p * v[d];
            }
        }
    }
}

/* Every block a sequence's context needs is listed and lies inside the cache. */
static int tables_are_valid(const int32_t *block_tables, const int32_t *seq_lens,
                            int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks) {
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t needed = ((int64_t)seq_lens[s] + block_size - 1) / block_size;
        if (seq_lens[s] < 0 || needed > max_blocks) return 0;
        for (int64_t b = 0; b < needed; ++b) {
            const int32_t block = block_tables[s * max_blocks + b];
            if (block < 0 || block >= num_blocks) return 0;
        }
    }
    return 1;
}

/*
 * Returns 0 on success, -1 if a work buffer could not be allocated, -2 if a block table
 * is too short for its sequence or names a block outside the cache (nothing is read then).
 */
int tollway_paged_decode_attention_f32(const float *q, const float *key_cache,
                                       const float *value_cache, const int32_t *block_tables,
                                       const int32_t *seq_lens, float *out, int64_t q_row_stride,
                                       int64_t num_seqs,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                       float scale, int num_threads) {
    if (!tables_are_valid(block_tables, seq_lens, num_seqs, num_blocks, block_size, max_blocks))
        return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; ++s) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    /* Work items: whole sequences (contiguous reads) when there are enough of them to keep
       every thread busy, else (sequence, KV head) pairs. */
    const int64_t kv_per_item = num_seqs >= 2 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
    const int64_t rows_per_item = kv_per_item * group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(rows_per_item * max_len) * sizeof(float));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
            if (scores == NULL) continue;
            const int64_t s = item / items_per_seq;
            const int64_t first_kv = (item % items_per_seq) * kv_per_item;
            const int64_t len = seq_lens[s];
            float *out_rows = out + (s * num_heads + first_kv * group) * head_dim;
            if (len <= 0) {
                memset(out_rows, 0, (size_t)(rows_per_item * head_dim) * sizeof(float));
                continue;
            }
            attend(q + s * q_row_stride + first_kv * group * head_dim, key_cache, value_cache,
                   block_tables + s * max_blocks, len, kv_per_item, group, head_dim, block_size,
                   token_stride, block_stride, first_kv * head_dim, scale, scores, out_rows);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
