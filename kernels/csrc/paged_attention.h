/*
 * Paged decode attention over KV blocks read in place (float32, bfloat16 or int8), one work
 * item at a time, shared by paged_attention_cpu.c (attention alone) and decoder_cpu.c (a
 * whole decode step); paged_attention_cpu.c's header describes the layout and the method.
 *
 * int8 caches (kernels/int8_kv_cache.py describes the layout and the rules) have one more
 * row per block, [num_blocks, block_size + 1, num_kv_heads, head_dim], whose first
 * 4 * num_kv_heads bytes are the block's float32 scales, one per KV head; a block's rows are
 * widened to q * scale as they are read, and store_token_int8 writes one token.
 */
#ifndef TOLLWAY_PAGED_ATTENTION_H
#define TOLLWAY_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_INT8 = 2 };

static inline float f32_of_bf16(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t bf16_of_f32(float x) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One layer's K or V cache as this kernel reads it: where an item's heads start in a
   token's row, and how to step between blocks and tokens (in elements). An int8 cache's
   scales for the item's heads lie at scales_offset past a block's start (its scale row),
   first_head floats in. */
typedef struct {
    const void *base;
    int dtype;
    int64_t block_stride, token_stride, head_offset;
    int64_t scales_offset, first_head, head_dim;
} CacheView;

/* How many blocks ahead of the one being read to prefetch (1, 2 and 4 measured within a
   few percent of each other; none was 10-20% slower on contexts past the L3). */
#define PREFETCH_BLOCKS 2

static inline size_t element_size(int dtype) {
    return dtype == DTYPE_INT8 ? 1 : dtype == DTYPE_BFLOAT16 ? 2 : 4;
}

/* Ask for every cache line of tokens [first, end) of a block's rows (this item's heads).
   Blocks lie anywhere in the cache, so the hardware prefetcher loses the stream at every
   block boundary; callers spread these requests over the work on the block before, as a
   burst of a whole block's lines would stall on the core's few outstanding-miss slots. */
static inline void prefetch_tokens(const CacheView *cache, int64_t block, int64_t first,
                                   int64_t end, int64_t width) {
    const size_t size = element_size(cache->dtype);
    const char *start =
        (const char *)cache->base + (block * cache->block_stride + cache->head_offset) * size;
    const int64_t row_bytes = width * (int64_t)size;
    for (int64_t j = first; j < end; ++j) {
        const char *row = start + j * cache->token_stride * (int64_t)size;
        for (int64_t offset = 0; offset < row_bytes; offset += 64)
            __builtin_prefetch(row + offset, 0, 3);
    }
}

/* The first n tokens of a block as float rows of `width` values, `*stride` apart: the cache
   itself for float32, else widened into `scratch` ([block_size, width] floats); int8 values
   times their head's scale (one rounding, as the reference's dequantization). */
static inline const float *block_rows(const CacheView *cache, int64_t block, int64_t n,
                                      int64_t width, float *restrict scratch, int64_t *stride) {
    const int64_t offset = block * cache->block_stride + cache->head_offset;
    if (cache->dtype == DTYPE_FLOAT32) {
        *stride = cache->token_stride;
        return (const float *)cache->base + offset;
    }
    if (cache->dtype == DTYPE_INT8) {
        const int8_t *src = (const int8_t *)cache->base + offset;
        const char *scale_row = (const char *)cache->base + block * cache->block_stride +
                                cache->scales_offset;
        const int64_t head_dim = cache->head_dim;
        for (int64_t h = 0; h * head_dim < width; ++h) {
            float scale;
            memcpy(&scale, scale_row + (cache->first_head + h) * (int64_t)sizeof(float),
                   sizeof scale);
            for (int64_t j = 0; j < n; ++j) {
                const int8_t *row = src + j * cache->token_stride + h * head_dim;
                float *dst = scratch + j * width + h * head_dim;
#pragma omp simd
                for (int64_t e = 0; e < head_dim; ++e) dst[e] = (float)row[e] * scale;
            }
        }
        *stride = width;
        return scratch;
    }
    const uint16_t *src = (const uint16_t *)cache->base + offset;
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t *row = src + j * cache->token_stride;
        float *dst = scratch + j * width;
#pragma omp simd
        for (int64_t e = 0; e < width; ++e) dst[e] = f32_of_bf16(row[e]);
    }
    *stride = width;
    return scratch;
}

/* 16 floats: one AVX-512 register, two AVX2 ones, four NEON ones. */
typedef float Lanes __attribute__((vector_size(64)));

static inline Lanes load_lanes(const float *src) {
    Lanes x;
    memcpy(&x, src, sizeof x);
    return x;
}

static inline float sum_lanes(Lanes x) {
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += x[i];
    return total;
}

/* out[0:CHUNKS*16] += sum_j p[j] * v[j * stride + ...], the sums held in registers. */
#define DEFINE_ACCUMULATE(CHUNKS)                                                            \
    static void accumulate_##CHUNKS(const float *restrict p, const float *restrict v,       \
                                    int64_t stride, int64_t n, float *restrict out) {        \
        Lanes sums[CHUNKS];                                                                  \
        for (int c = 0; c < CHUNKS; ++c) sums[c] = (Lanes){0};                               \
        for (int64_t j = 0; j < n; ++j) {                                                    \
            const float pj = p[j];                                                           \
            const float *row = v + j * stride;                                               \
            for (int c = 0; c < CHUNKS; ++c) sums[c] += pj * load_lanes(row + 16 * c);       \
        }                                                                                    \
        for (int c = 0; c < CHUNKS; ++c) {                                                   \
            const Lanes total = load_lanes(out + 16 * c) + sums[c];                          \
            memcpy(out + 16 * c, &total, sizeof total);                                      \
        }                                                                                    \
    }
DEFINE_ACCUMULATE(4)
DEFINE_ACCUMULATE(8)

/* Sixteen dot products' partial-sum vectors reduced to one vector of their sums, in order:
   a tree of lane shuffles and adds (46 operations) instead of sixteen horizontal sums. Each
   level halves the partial sums per product and doubles the products per vector. */
#define SHUFFLE __builtin_shufflevector
static inline Lanes sum_each_of_16(const Lanes d[16]) {
    Lanes w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i) /* lanes 0-7: d[2i]'s partials, 8-15: d[2i+1]'s */
        w[i] = SHUFFLE(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                       22, 23) +
               SHUFFLE(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                       29, 30, 31);
    for (int i = 0; i < 4; ++i) /* four lanes each: d[4i], d[4i+2], d[4i+1], d[4i+3] */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                       26, 27) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                       30, 31);
    for (int i = 0; i < 2; ++i) /* two lanes each */
        y[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                       28, 29) +
               SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                       30, 31);
    const Lanes z = /* one lane each, lane i holding d[bit-reversed i] */
        SHUFFLE(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
        SHUFFLE(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return SHUFFLE(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* scores[j] = scale * q . k[j * stride + ...] for the n keys of a block, sixteen at a time. */
#define DEFINE_SCORE(CHUNKS)                                                                 \
    static void score_##CHUNKS(const float *restrict q, const float *restrict k,            \
                               int64_t stride, int64_t n, float scale,                       \
                               float *restrict scores) {                                     \
        Lanes query[CHUNKS];                                                                 \
        for (int c = 0; c < CHUNKS; ++c) query[c] = load_lanes(q + 16 * c);                  \
        int64_t j = 0;                                                                       \
        for (; j + 16 <= n; j += 16) {                                                       \
            Lanes dots[16];                                                                  \
            for (int t = 0; t < 16; ++t) {                                                   \
                const float *row = k + (j + t) * stride;                                     \
                dots[t] = query[0] * load_lanes(row);                                        \
                for (int c = 1; c < CHUNKS; ++c)                                             \
                    dots[t] += query[c] * load_lanes(row + 16 * c);                          \
            }                                                                                \
            const Lanes sums = sum_each_of_16(dots) * scale;                                 \
            memcpy(scores + j, &sums, sizeof sums);                                          \
        }                                                                                    \
        for (; j < n; ++j) {                                                                 \
            const float *row = k + j * stride;                                               \
            Lanes dot = query[0] * load_lanes(row);                                          \
            for (int c = 1; c < CHUNKS; ++c) dot += query[c] * load_lanes(row + 16 * c);     \
            scores[j] = sum_lanes(dot) * scale;                                              \
        }                                                                                    \
    }
DEFINE_SCORE(4)
DEFINE_SCORE(8)

static void score_keys(const float *restrict q, const float *restrict k, int64_t stride,
                       int64_t n, int64_t head_dim, float scale, float *restrict scores) {
    if (head_dim == 64) {
        score_4(q, k, stride, n, scale, scores);
    } else if (head_dim == 128) {
        score_8(q, k, stride, n, scale, scores);
    } else {
        for (int64_t j = 0; j < n; ++j) {
            const float *row = k + j * stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * row[d];
            scores[j] = dot * scale;
        }
    }
}

static void accumulate_values(const float *restrict p, const float *restrict v,
                              int64_t stride, int64_t n, int64_t head_dim,
                              float *restrict out) {
    if (head_dim == 64) {
        accumulate_4(p, v, stride, n, out);
    } else if (head_dim == 128) {
        accumulate_8(p, v, stride, n, out);
    } else {
        for (int64_t j = 0; j < n; ++j) {
            const float pj = p[j];
            const float *row = v + j * stride;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) out[d] += pj * row[d];
        }
    }
}

/*
 * A sequence's context is cut into partitions of whole blocks. Each partition leaves, per
 * query row, its scores' max m, the sum l of exp(score - m) and the values weighted by those
 * exponentials; the sequence's partitions are then combined in order (the max M of their m,
 * then sum exp(m - M) * values / sum exp(m - M) * l, as flash decoding does).
 *
 * Work items: with at least two sequences per thread, whole sequences (a thread runs the
 * sequence's partitions in order and combines them itself); with fewer, one partition each
 * against every query head, and a second pass combines them, a (sequence, head) at a time.
 * Why: one decoding sequence had one item per KV head (3 on SmolLM2 for 2 threads: one thread
 * idle for a third of the attention, 1.3x slower at 4,096 tokens). Either way an item reads
 * whole token rows, front to back.
 *
 * A sequence's partitions depend on its own length and the block size alone, and both kinds
 * of item do the same arithmetic in the same order, so its output has the same bits in any
 * batch and for any thread count.
 */
#define MAX_PARTITIONS 16
#define MIN_PARTITION_BLOCKS 4 /* 2 measured 0-2% slower in a SmolLM2 decode step; 1, 10-15%
                                  slower on batches (each partition's softmax and combine) */

/* Blocks per partition for a context of num_blocks blocks: MIN_PARTITION_BLOCKS, or more so
   that there are at most MAX_PARTITIONS (the last may be shorter). */
static inline int64_t partition_blocks(int64_t num_blocks) {
    const int64_t even = (num_blocks + MAX_PARTITIONS - 1) / MAX_PARTITIONS;
    return even > MIN_PARTITION_BLOCKS ? even : MIN_PARTITION_BLOCKS;
}

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, group, block_size, max_blocks;
    int split;                  /* items are partitions (else whole sequences) */
    int64_t items_per_seq;      /* split: the most partitions of any sequence; else 1 */
    int64_t max_partition;      /* the most tokens of any partition */
    float scale;
} AttentionItems;

static AttentionItems attention_items(const int32_t *seq_lens, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t max_blocks, float scale,
                                      int num_threads) {
    int64_t partitions = 1, max_partition = 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t blocks = ((int64_t)seq_lens[s] + block_size - 1) / block_size;
        const int64_t per = partition_blocks(blocks);
        const int64_t count = (blocks + per - 1) / per;
        partitions = count > partitions ? count : partitions;
        max_partition = per * block_size > max_partition ? per * block_size : max_partition;
    }
    const int split = num_seqs < 2 * (int64_t)num_threads;
    const AttentionItems items = {
        .num_heads = num_heads,
        .num_kv_heads = num_kv_heads,
        .head_dim = head_dim,
        .group = num_heads / num_kv_heads,
        .block_size = block_size,
        .max_blocks = max_blocks,
        .split = split,
        .items_per_seq = split ? partitions : 1,
        .max_partition = max_partition,
        .scale = scale,
    };
    return items;
}

/* Floats of one partition's results: [heads, 2 + head_dim] (m, l, the weighted values). */
static inline int64_t partial_floats(const AttentionItems *items) {
    return items->num_heads * (2 + items->head_dim);
}

/* Floats of one thread's work buffer: scores [heads, max_partition] | scratch [block_size,
   kv heads * head_dim] (widened rows) | q [heads, head_dim] | one sequence's partials
   [MAX_PARTITIONS, ...] (whole-sequence items). */
static size_t attention_buffer_floats(const AttentionItems *items) {
    return (size_t)(items->num_heads * items->max_partition +
                    items->block_size * items->num_kv_heads * items->head_dim +
                    items->num_heads * items->head_dim + MAX_PARTITIONS * partial_floats(items));
}

/* Floats of the step's shared partial results: [num_seqs, items_per_seq, heads, 2 +
   head_dim] when split, else none. */
static size_t attention_partial_floats(const AttentionItems *items, int64_t num_seqs) {
    return items->split ? (size_t)(num_seqs * items->items_per_seq * partial_floats(items)) : 0;
}

/*
 * One partition: pass 1 scores every query row against the partition's keys, block by block
 * (each key read once, its row's heads consecutive; the group's query rows share each KV
 * head's load from L1); then each row's max and exponentials; pass 2 sums the values
 * weighted by them. Blocks lie anywhere in the cache, so the hardware prefetcher loses the
 * stream at each block boundary: pass 1 prefetches the keys two blocks ahead and this
 * block's values, pass 2 the values two blocks ahead, in slices between query rows.
 */
static void attend_partition(const float *restrict q, const CacheView *keys,
                             const CacheView *values, const int32_t *restrict table,
                             int64_t len, int64_t num_kv, int64_t group, int64_t head_dim,
                             int64_t block_size, float scale, float *restrict scores,
                             float *restrict scratch, float *restrict partial) {
    const int64_t rows = num_kv * group, width = num_kv * head_dim, stride_p = 2 + head_dim;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    int64_t stride;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t ahead = b + PREFETCH_BLOCKS;
        const int64_t ahead_n =
            len - ahead * block_size < block_size ? len - ahead * block_size : block_size;
        const float *k_block = block_rows(keys, table[b], n, width, scratch, &stride);
        for (int64_t r = 0; r < rows; ++r) {
            if (ahead < num_blocks) /* this row's share of the blocks ahead */
                prefetch_tokens(keys, table[ahead], r * ahead_n / rows, (r + 1) * ahead_n / rows,
                                width);
            prefetch_tokens(values, table[b], r * n / rows, (r + 1) * n / rows, width);
            score_keys(q + r * head_dim, k_block + (r / group) * head_dim, stride, n, head_dim,
                       scale, scores + r * len + start);
        }
    }
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
        float *out = partial + r * stride_p;
        out[0] = max_score;
        out[1] = total;
        memset(out + 2, 0, (size_t)head_dim * sizeof(float));
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t ahead = b + PREFETCH_BLOCKS;
        const int64_t ahead_n =
            len - ahead * block_size < block_size ? len - ahead * block_size : block_size;
        const float *v_block = block_rows(values, table[b], n, width, scratch, &stride);
        for (int64_t r = 0; r < rows; ++r) {
            if (ahead < num_blocks)
                prefetch_tokens(values, table[ahead], r * ahead_n / rows,
                                (r + 1) * ahead_n / rows, width);
            accumulate_values(scores + r * len + start, v_block + (r / group) * head_dim,
                              stride, n, head_dim, partial + r * stride_p + 2);
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

/* How many partitions sequence s has, and blocks per partition. */
static inline int64_t partitions_of(const AttentionItems *items, const int32_t *seq_lens,
                                    int64_t s, int64_t *per) {
    const int64_t blocks = ((int64_t)seq_lens[s] + items->block_size - 1) / items->block_size;
    *per = partition_blocks(blocks);
    return (blocks + *per - 1) / *per;
}

/* Head h of sequence s's output from its `count` partitions' results (`partials`, the
   first partition's, `step` floats apart), combined in order; zeros for no partition. out
   as q: [num_seqs, num_heads, head_dim] of dtype. */
static void combine_head(const AttentionItems *items, int64_t s, int64_t h, int64_t count,
                         const float *partials, int64_t step, int dtype, void *out) {
    const int64_t head_dim = items->head_dim;
    const float *first = partials + h * (2 + head_dim);
    float combined[head_dim];
    memset(combined, 0, sizeof combined);
    float max_score = count > 0 ? first[0] : 0.0f, total = 0.0f;
    for (int64_t p = 1; p < count; ++p)
        max_score = first[p * step] > max_score ? first[p * step] : max_score;
    for (int64_t p = 0; p < count; ++p) {
        const float *partial = first + p * step;
        const float weight = expf(partial[0] - max_score);
        total += weight * partial[1];
#pragma omp simd
        for (int64_t e = 0; e < head_dim; ++e) combined[e] += weight * partial[2 + e];
    }
    const float inv_total = count > 0 ? 1.0f / total : 0.0f;
    const int64_t offset = (s * items->num_heads + h) * head_dim;
    if (dtype == DTYPE_FLOAT32) {
        float *dst = (float *)out + offset;
        for (int64_t e = 0; e < head_dim; ++e) dst[e] = combined[e] * inv_total;
    } else {
        uint16_t *dst = (uint16_t *)out + offset;
        for (int64_t e = 0; e < head_dim; ++e) dst[e] = bf16_of_f32(combined[e] * inv_total);
    }
}

/* Work item `item` (attention_items): a partition's results into `partials` (split), or a
   whole sequence's output into `out`. q: [num_seqs, num_heads, head_dim], rows q_row_stride
   apart, of dtype (float32 or bfloat16), out likewise (contiguous); the caches as in the
   header, of cache_dtype (dtype, or DTYPE_INT8). */
static void attend_item_caches(const AttentionItems *items, int64_t item, const void *q,
                               int64_t q_row_stride, const void *key_cache,
                               const void *value_cache, int dtype, int cache_dtype,
                               const int32_t *block_tables, const int32_t *seq_lens,
                               float *partials, void *out, float *buffer) {
    const int64_t s = item / items->items_per_seq;
    const int64_t head_dim = items->head_dim, block_size = items->block_size;
    const int64_t width = items->num_kv_heads * head_dim, values = items->num_heads * head_dim;
    int64_t per;
    const int64_t count = partitions_of(items, seq_lens, s, &per);
    const int64_t first = items->split ? item % items->items_per_seq : 0;
    const int64_t end = items->split ? first + 1 : count;
    if (first >= count) {
        if (!items->split) /* an empty context */
            for (int64_t h = 0; h < items->num_heads; ++h)
                combine_head(items, s, h, 0, buffer, 0, dtype, out);
        return;
    }
    float *scores = buffer;
    float *scratch = scores + items->num_heads * items->max_partition;
    float *q_item = scratch + block_size * width;
    float *own = q_item + values; /* a whole sequence's partials */
    if (dtype == DTYPE_FLOAT32) {
        memcpy(q_item, (const float *)q + s * q_row_stride, (size_t)values * sizeof(float));
    } else {
        const uint16_t *q_bf16 = (const uint16_t *)q + s * q_row_stride;
        for (int64_t e = 0; e < values; ++e) q_item[e] = f32_of_bf16(q_bf16[e]);
    }
    const int64_t rows_per_block = block_size + (cache_dtype == DTYPE_INT8 ? 1 : 0);
    const CacheView keys = {
        .base = key_cache,
        .dtype = cache_dtype,
        .block_stride = rows_per_block * width,
        .token_stride = width,
        .head_offset = 0,
        .scales_offset = block_size * width,
        .first_head = 0,
        .head_dim = head_dim,
    };
    CacheView value_view = keys;
    value_view.base = value_cache;
    const int64_t len = seq_lens[s];
    for (int64_t p = first; p < end; ++p) {
        const int64_t start = p * per * block_size;
        const int64_t tokens = len - start < per * block_size ? len - start : per * block_size;
        float *partial = items->split ? partials + item * partial_floats(items)
                                      : own + p * partial_floats(items);
        attend_partition(q_item, &keys, &value_view,
                         block_tables + s * items->max_blocks + p * per, tokens,
                         items->num_kv_heads, items->group, head_dim, block_size, items->scale,
                         scores, scratch, partial);
    }
    if (!items->split)
        for (int64_t h = 0; h < items->num_heads; ++h)
            combine_head(items, s, h, count, own, partial_floats(items), dtype, out);
}

/* A thread's share of a step's items when they are shared statically (the decoder's: each
   thread fetches its own items' KV ahead), [*first, *end) in order: partitions (split) by
   count, whole sequences by their KV blocks (an item goes to the thread its middle block
   falls to), so unequal contexts still share the reading about evenly. */
static inline void thread_items(const AttentionItems *items, const int32_t *seq_lens,
                                int64_t num_seqs, int thread, int team, int64_t *first,
                                int64_t *end) {
    const int64_t num_items = num_seqs * items->items_per_seq;
    if (items->split) {
        *first = num_items * thread / team;
        *end = num_items * (thread + 1) / team;
        return;
    }
    const int64_t block_size = items->block_size;
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += (seq_lens[s] + block_size - 1) / block_size;
    *first = *end = num_seqs;
    int64_t before = 0; /* blocks of the sequences before s */
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
        const int64_t owner =
            total > 0 ? (2 * before + blocks) * team / (2 * total) : s * team / num_seqs;
        if (owner >= thread && *first == num_seqs) *first = s;
        if (owner >= thread + 1) {
            *end = s;
            break;
        }
        before += blocks;
    }
    if (*end < *first) *end = *first;
}

/* Bytes of one KV block of one cache: its token rows (and an int8 block's scale row). */
static inline int64_t cache_block_bytes(const AttentionItems *items, int cache_dtype) {
    const int64_t rows = items->block_size + (cache_dtype == DTYPE_INT8 ? 1 : 0);
    return rows * items->num_kv_heads * items->head_dim * (int64_t)element_size(cache_dtype);
}

/* Appends to `blocks` the start of every KV block item `item` reads, in the order it reads
   them (a key block, then its value block); returns how many it appended. */
static inline int64_t item_cache_blocks(const AttentionItems *items, int64_t item,
                                 const int32_t *seq_lens, const int32_t *block_tables,
                                 const void *key_cache, const void *value_cache,
                                 int cache_dtype, const uint8_t **blocks) {
    const int64_t s = item / items->items_per_seq, block_size = items->block_size;
    int64_t per;
    const int64_t count = partitions_of(items, seq_lens, s, &per);
    const int64_t first = items->split ? item % items->items_per_seq : 0;
    const int64_t end = items->split ? first + 1 : count;
    if (first >= count) return 0;
    const int64_t num_blocks = ((int64_t)seq_lens[s] + block_size - 1) / block_size;
    const int64_t last = end * per < num_blocks ? end * per : num_blocks;
    const int64_t bytes = cache_block_bytes(items, cache_dtype);
    int64_t n = 0;
    for (int64_t b = first * per; b < last; ++b) {
        const int64_t block = block_tables[s * items->max_blocks + b];
        blocks[n++] = (const uint8_t *)key_cache + block * bytes;
        blocks[n++] = (const uint8_t *)value_cache + block * bytes;
    }
    return n;
}

/* After a split step's items: item (sequence item / num_heads, head item % num_heads) of
   the second pass, its partitions combined into out. */
static void combine_item(const AttentionItems *items, int64_t item, const int32_t *seq_lens,
                         const float *partials, int dtype, void *out) {
    const int64_t s = item / items->num_heads, h = item % items->num_heads;
    int64_t per;
    const int64_t count = partitions_of(items, seq_lens, s, &per);
    combine_head(items, s, h, count, partials + s * items->items_per_seq * partial_floats(items),
                 partial_floats(items), dtype, out);
}

/* One head's int8 quantization of a token row into its block, by kernels/int8_kv_cache.py's
   rules (exact float32 arithmetic, so it matches the PyTorch reference bit for bit):
   `values` are the block's rows of this head (token_stride apart), `offset` the token's row,
   `*scale` the head's scale (reset when offset is 0; grown, and the earlier rows
   requantized, when x does not fit). */
__attribute__((optimize("no-fast-math"))) static void quantize_head_int8(
    int8_t *values, int64_t token_stride, int64_t offset, float *scale, const float *x,
    int64_t head_dim) {
    float amax = 0.0f;
    for (int64_t e = 0; e < head_dim; ++e) amax = fmaxf(amax, fabsf(x[e]));
    float new_scale = *scale;
    if (offset == 0) {
        new_scale = amax / 127.0f;
    } else if (amax > *scale * 127.0f) {
        new_scale = fmaxf(amax / 127.0f, *scale * 1.25f);
        const float ratio = *scale / new_scale;
        for (int64_t j = 0; j < offset; ++j) {
            int8_t *row = values + j * token_stride;
            for (int64_t e = 0; e < head_dim; ++e) row[e] = (int8_t)rintf((float)row[e] * ratio);
        }
    }
    int8_t *row = values + offset * token_stride;
    for (int64_t e = 0; e < head_dim; ++e) {
        const float q = new_scale > 0.0f ? rintf(x[e] / new_scale) : 0.0f;
        row[e] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
    *scale = new_scale;
}

/* Store one token's key and value rows (float32, [num_kv_heads * head_dim] each) into slot
   `slot` (>= 0, inside the cache) of int8 caches [num_blocks, block_size + 1, num_kv_heads,
   head_dim]. A block's tokens must be stored in slot order (see kernels/int8_kv_cache.py). */
static inline void store_token_int8(int8_t *key_cache, int8_t *value_cache, int64_t slot,
                                    const float *key, const float *value, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t block_size) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_start = (slot / block_size) * (block_size + 1) * token_stride;
    const int64_t offset = slot % block_size;
    int8_t *caches[2] = {key_cache, value_cache};
    const float *rows[2] = {key, value};
    for (int c = 0; c < 2; ++c) {
        int8_t *block = caches[c] + block_start;
        char *scale_row = (char *)(block + block_size * token_stride);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            float scale;
            memcpy(&scale, scale_row + h * (int64_t)sizeof(float), sizeof scale);
            quantize_head_int8(block + h * head_dim, token_stride, offset, &scale,
                               rows[c] + h * head_dim, head_dim);
            memcpy(scale_row + h * (int64_t)sizeof(float), &scale, sizeof scale);
        }
    }
}

#endif
