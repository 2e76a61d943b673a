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
 * queries are consecutive and share each key and value load. Work items are
 * (sequence, kv head) pairs, spread over OpenMP threads; with PyTorch loaded first the
 * process has one OpenMP runtime (PyTorch's libgomp.so.1), shared with its own ops.
 *
 * Per item: pass 1 computes the group's scores for the whole context into a per-thread
 * buffer (keys read once), then the softmax, then pass 2 accumulates the values (read
 * once). The scores buffer is group * max_len floats, small enough to stay in L2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOLLWAY_ABI_VERSION 3

int tollway_abi_version(void) { return TOLLWAY_ABI_VERSION; }

static void attend_one(const float *restrict q,  /* [group, head_dim] */
                       const float *restrict key_cache, const float *restrict value_cache,
                       const int32_t *restrict table, int64_t len, int64_t group,
                       int64_t head_dim, int64_t block_size, int64_t token_stride,
                       int64_t block_stride, int64_t head_offset, float scale,
                       float *restrict scores, /* [group, len] */
                       float *restrict out /* [group, head_dim] */) {
    /* Pass 1: scores[g][t] = scale * q[g] . k[t] */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *k_block = key_cache + block * block_stride + head_offset;
        for (int64_t j = 0; j < n; ++j) {
            const float *k = k_block + j * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = q + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
                scores[g * len + start + j] = dot * scale;
            }
        }
    }
    /* Softmax over each query's row; rows of out start at zero. */
    for (int64_t g = 0; g < group; ++g) {
        float *row = scores + g * len;
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
    memset(out, 0, (size_t)(group * head_dim) * sizeof(float));
    /* Pass 2: out[g] = sum_t p[g][t] * v[t] */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *v_block = value_cache + block * block_stride + head_offset;
        for (int64_t j = 0; j < n; ++j) {
            const float *v = v_block + j * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * len + start + j];
                float *og = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) og[d] += p * v[d];
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
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(group * max_len) * sizeof(float));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
            if (scores == NULL) continue;
            const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t first_head = s * num_heads + h * group;
            const int64_t len = seq_lens[s];
            if (len <= 0) {
                memset(out + first_head * head_dim, 0, (size_t)(group * head_dim) * sizeof(float));
                continue;
            }
            attend_one(q + s * q_row_stride + h * group * head_dim, key_cache, value_cache,
                       block_tables + s * max_blocks, len, group, head_dim, block_size,
                       token_stride, block_stride, h * head_dim, scale, scores,
                       out + first_head * head_dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
