/*
 * y = x @ W.T where W [N, K] stays in a GGUF file's quantized blocks (ggml's layouts), on a
 * slice of W's rows: shared by quant_linear_cpu.c (one linear per call) and decoder_cpu.c
 * (every linear of a decode step in one call). quant_linear_cpu.c's header says what the
 * layouts and the two methods are.
 */
#ifndef TOLLWAY_QUANT_LINEAR_ROWS_H
#define TOLLWAY_QUANT_LINEAR_ROWS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_blocks.h"
#include "quant_int8_rows.h"

#define M_CHUNK 64 /* rows of x kept hot in cache while a thread walks its outputs */

#include "quant_tiles.h"

/* The method argument. INT8_SPLIT_ACTIVATIONS: x = hi + lo, both int8 blocks (lo rounds what
   hi left over), so W @ x is two integer dot products per block sharing one read of W. */
enum { QUANT_DECODE_TO_FLOAT = 0, QUANT_INT8_ACTIVATIONS = 1, QUANT_INT8_SPLIT_ACTIVATIONS = 2 };

/* Rows of int8 activations a method keeps per row of x. */
static inline int64_t quant_rows_per_input(int method) {
    return method == QUANT_INT8_SPLIT_ACTIVATIONS ? 2 : 1;
}

static inline qv16 qload16(const float *p) {
    qv16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float qsum16(qv16 v) {
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += v[i];
    return total;
}

/* ---- DECODE_TO_FLOAT ---------------------------------------------------------------- */

/* y[m0 : m0 + rows, n] for one row of W, rows <= ROW_TILE. */
static inline __attribute__((always_inline)) void float_row(const uint8_t *wrow, int type,
                                                            int64_t bytes, const float *x,
                                                            float *y, int64_t N, int64_t K,
                                                            int64_t n, int64_t m0,
                                                            const int rows) {
    qv16 acc[ROW_TILE][2];
    memset(acc, 0, sizeof acc);
    const int sub_blocks = (int)(quant_block_values(type) / QK);
    for (int64_t b = 0; b < K / QK; b += sub_blocks) {
        const uint8_t *block = wrow + b / sub_blocks * bytes;
#pragma GCC unroll 8 /* a constant sub-block index: constant shifts in decode_sub_block */
        for (int s = 0; s < sub_blocks; ++s) {
            qv16 w0, w1;
            decode_block(block, type, s, &w0, &w1);
            for (int r = 0; r < rows; ++r) {
                const float *xb = x + (m0 + r) * K + (b + s) * QK;
                acc[r][0] += w0 * qload16(xb);
                acc[r][1] += w1 * qload16(xb + 16);
            }
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = qsum16(acc[r][0] + acc[r][1]);
}

/* The row functions with the type and the tile's row count constants: each type's loop
   without a branch on the type, the accumulators in registers. */
#define QUANT_ROWS_OF(row_function, type_id, ...)                                              \
    case type_id:                                                                             \
        switch (rows) {                                                                       \
        case 1: row_function(wrow, type_id, __VA_ARGS__, 1); break;                           \
        case 2: row_function(wrow, type_id, __VA_ARGS__, 2); break;                           \
        case 3: row_function(wrow, type_id, __VA_ARGS__, 3); break;                           \
        default: row_function(wrow, type_id, __VA_ARGS__, 4); break;                          \
        }                                                                                     \
        break

static void float_rows(const uint8_t *wrow, int type, int64_t bytes, const float *x, float *y,
                       int64_t N, int64_t K, int64_t n, int64_t m0, int64_t rows) {
#define FLOAT_ROWS(type_id) QUANT_ROWS_OF(float_row, type_id, bytes, x, y, N, K, n, m0)
    switch (type) {
        FLOAT_ROWS(TYPE_Q4_0);
        FLOAT_ROWS(TYPE_Q4_1);
        FLOAT_ROWS(TYPE_Q5_0);
        FLOAT_ROWS(TYPE_Q5_1);
        FLOAT_ROWS(TYPE_Q8_0);
        FLOAT_ROWS(TYPE_Q4_K);
        FLOAT_ROWS(TYPE_Q5_K);
        FLOAT_ROWS(TYPE_Q6_K);
    }
#undef FLOAT_ROWS
}

static void int8_rows(const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq,
                      const float *xd, const float *xdsum, float *y, int64_t N, int64_t K,
                      int64_t n, int64_t m0, int64_t rows) {
#define INT8_ROWS(row_function, type_id)                                                       \
    QUANT_ROWS_OF(row_function, type_id, bytes, xq, xd, xdsum, y, N, K, n, m0)
    switch (type) {
        INT8_ROWS(int8_row, TYPE_Q4_0);
        INT8_ROWS(int8_row, TYPE_Q4_1);
        INT8_ROWS(int8_row, TYPE_Q5_0);
        INT8_ROWS(int8_row, TYPE_Q5_1);
        INT8_ROWS(int8_row, TYPE_Q8_0);
        INT8_ROWS(int8_row_q45k, TYPE_Q4_K);
        INT8_ROWS(int8_row_q45k, TYPE_Q5_K);
        INT8_ROWS(int8_row_q6k, TYPE_Q6_K);
    }
#undef INT8_ROWS
}
#undef QUANT_ROWS_OF

/* ---- a linear shared by an OpenMP team ------------------------------------------------ */

/* x's row as two int8 rows: hi as quantize_row, then lo = the rest, x - hi, on a grid 256 times
   finer than hi's (lo's scale is hi's / 256, exact), clamped to +-127. |x - (hi + lo)| <=
   max|x_block| / (127 * 512) per element, or / (127 * 256) where the clamp bites: the ~16-bit
   activations of two int8 passes. The fixed ratio lets the 32-value block types sum both
   passes in one integer (split_row). isum[b] = 256 * sum(hi) + sum(lo), block b's values on
   lo's grid (the tiled kernel's bias term, quant_tiles.h). */
static void quantize_row_split(const float *x, int64_t K, int8_t *q_hi, float *d_hi,
                               float *dsum_hi, int8_t *q_lo, float *d_lo, float *dsum_lo,
                               int32_t *isum) {
    quantize_row(x, K, q_hi, d_hi, dsum_hi);
    for (int64_t b = 0; b < K / QK; ++b) {
        int hi_sum = 0;
        for (int i = 0; i < QK; ++i) hi_sum += q_hi[b * QK + i];
        const float inverse = d_hi[b] > 0.0f ? 256.0f / d_hi[b] : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; ++i) {
            const float rest = x[b * QK + i] - d_hi[b] * (float)q_hi[b * QK + i];
            int v = (int)roundf(rest * inverse);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q_lo[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d_lo[b] = d_hi[b] / 256.0f;
        dsum_lo[b] = d_lo[b] * (float)sum;
        isum[b] = 256 * hi_sum + sum;
    }
}

/* Blocks [first, last) of x's row m as int8 blocks for `method` (xq [R, K], xd and xdsum
   [R, K / QK], R = M times quant_rows_per_input: the split method's hi and lo rows of x's row m
   are rows 2m and 2m + 1, and isum [M, K / QK] its blocks' integer sums). Blocks are rounded
   independently, so any split of them among threads gives the same bits. */
static inline void quant_activation_blocks(const float *x, int64_t m, int64_t K, int64_t first,
                                           int64_t last, int method, int8_t *xq, float *xd,
                                           float *xdsum, int32_t *isum) {
    const int64_t nb = K / QK, values = (last - first) * QK, at = m * K + first * QK;
    if (method == QUANT_INT8_SPLIT_ACTIVATIONS) {
        const int64_t hi = 2 * m * nb + first, lo = hi + nb; /* rows 2m and 2m + 1 */
        quantize_row_split(x + at, values, xq + hi * QK, xd + hi, xdsum + hi, xq + lo * QK,
                           xd + lo, xdsum + lo, isum + m * nb + first);
    } else {
        quantize_row(x + at, values, xq + at, xd + m * nb + first, xdsum + m * nb + first);
    }
}

/* x's rows as int8 blocks (quant_activation_blocks), the M * K / QK blocks split evenly over
   the team (so one row is shared too: a decode step of one sequence had one thread round it
   while the others waited): every thread of the team calls it. The caller puts a barrier
   after it. */
static inline void quant_activations_slice(const float *x, int64_t M, int64_t K, int method,
                                           int8_t *xq, float *xd, float *xdsum, int32_t *isum,
                                           int thread, int team) {
    const int64_t nb = K / QK, end = M * nb * (thread + 1) / team;
    for (int64_t unit = M * nb * thread / team; unit < end;) {
        const int64_t m = unit / nb, first = unit % nb;
        const int64_t last = end - m * nb < nb ? end - m * nb : nb; /* row m's blocks here */
        quant_activation_blocks(x, m, K, first, last, method, xq, xd, xdsum, isum);
        unit = m * nb + last;
    }
}

/* The split method's outputs for x's rows [m0 / 2, (m0 + rows) / 2): each the sum of its hi and
   lo rows' dot products. The 32-value types sum both in one integer per block (split_row); the
   super-block types take them as two activation rows (into a scratch row, then added). */
static inline void split_rows(const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq,
                              const float *xd, const float *xdsum, float *y, int64_t N,
                              int64_t K, int64_t n, int64_t m0, int64_t rows) {
#if INT8_ISA > 0
#define SPLIT_ROWS(type_id)                                                                    \
    case type_id:                                                                             \
        if (rows == 2) split_row(wrow, type_id, bytes, xq, xd, xdsum, y, N, K, n, m0 / 2, 1);  \
        else split_row(wrow, type_id, bytes, xq, xd, xdsum, y, N, K, n, m0 / 2, 2);            \
        return
    switch (type) {
        SPLIT_ROWS(TYPE_Q4_0);
        SPLIT_ROWS(TYPE_Q4_1);
        SPLIT_ROWS(TYPE_Q5_0);
        SPLIT_ROWS(TYPE_Q5_1);
        SPLIT_ROWS(TYPE_Q8_0);
    }
#undef SPLIT_ROWS
#endif
    const int64_t nb = K / QK;
    float pairs[ROW_TILE];
    int8_rows(wrow, type, bytes, xq + m0 * K, xd + m0 * nb, xdsum + m0 * nb, pairs, 1, K, 0, 0,
              rows);
    for (int64_t j = 0; j < rows / 2; ++j) y[(m0 / 2 + j) * N + n] = pairs[2 * j] + pairs[2 * j + 1];
}

/* Block b of row n of a tiled W of a 32-value type, back in the file's bytes (quant_tiles.h's
   layout: the tile-block's scales, mins and quant words for lane n % 16). */
static inline void untile_block(const uint8_t *w, int type, int64_t K, int64_t n, int64_t b,
                         uint8_t *block) {
    const int64_t tile_block = TILE_ROWS * quant_block_bytes(type);
    const uint8_t *tile = w + n / TILE_ROWS * (K / QK) * tile_block + b * tile_block;
    const int lane = (int)(n % TILE_ROWS), has_min = type == TYPE_Q4_1;
    const int header = has_min ? 64 : 32, fields = has_min ? 4 : 2;
    const int words = type == TYPE_Q8_0 ? 8 : 4; /* quant bytes / 4 */
    memcpy(block, tile + 2 * lane, 2);
    if (has_min) memcpy(block + 2, tile + 32 + 2 * lane, 2);
    for (int g = 0; g < words; ++g)
        memcpy(block + fields + 4 * g, tile + header + 64 * g + 4 * lane, 4);
    if (type == TYPE_Q8_0) /* stored q + 128 */
        for (int i = 0; i < 4 * words; ++i) block[fields + i] ^= 0x80;
}

/* W [N, K] of `type` (maybe tiled) is one widen_row reads. */
static inline int rows_can_widen(int type, int64_t N, int64_t K) {
    const int base = untiled_type(type);
    const int64_t values = quant_block_values(base);
    if (values == 0 || N < 1 || K < values || K % values != 0) return 0;
    return !is_tiled_type(type) || (QUANT_TILES && tileable_type(base) && N % TILE_ROWS == 0);
}

/* Row n of W [N, K] (type, or a tiled 32-value type) widened to float32 into out[K], as
   tollway_quant_dequantize widens it: an embedding's token, without untiling the rest. */
static inline void widen_row(const uint8_t *w, int type, int64_t K, int64_t n, float *out) {
    const int base = untiled_type(type), tiled = is_tiled_type(type);
    const int64_t values = quant_block_values(base), bytes = quant_block_bytes(base);
    for (int64_t b = 0; b < K / values; ++b) {
        uint8_t copy[2 + 2 + QK]; /* the largest tiled block, Q8_0 (34 bytes) */
        const uint8_t *block = w + (n * (K / values) + b) * bytes;
        if (tiled) {
            untile_block(w, base, K, n, b, copy);
            block = copy;
        }
        for (int s = 0; s < (int)(values / QK); ++s) {
            qv16 first, second;
            decode_block(block, base, s, &first, &second);
            float *row = out + b * values + s * QK;
            memcpy(row, &first, sizeof first);
            memcpy(row + 16, &second, sizeof second);
        }
    }
}

/* y[:, first:last] (+ bias) of y = x @ W.T, W [N, K] of ggml blocks of `type`: the outputs one
   thread owns. The int8 methods read xq/xd/xdsum (quant_activations_slice's, all rows);
   DECODE_TO_FLOAT reads x. A tiled type (quant_tiles.h: the split method only; first and last
   multiples of TILE_ROWS) also reads isum, and its last tiles prefetch `then` and each tile
   `drip`'s next lines (quant_tiles.h). Each output is one thread's, summed in one fixed
   order. */
static inline void quant_linear_slice(const uint8_t *w, int type, const float *x,
                                      const int8_t *xq, const float *xd, const float *xdsum,
                                      const int32_t *isum, const float *bias, float *y,
                                      int64_t M, int64_t N, int64_t K, int method, int64_t first,
                                      int64_t last, PrefetchRun then, LineDrip *drip) {
#if QUANT_TILES
    if (is_tiled_type(type)) {
        tiled_linear_slice(w, untiled_type(type), xq, xd, xdsum, isum, bias, y, M, N, K, first,
                           last, then, drip);
        return;
    }
#endif
    (void)then, (void)drip; /* row kernels: the hardware prefetcher follows their rows */
    const int64_t bytes = quant_block_bytes(type), row_bytes = K / quant_block_values(type) * bytes;
    const int64_t per_input = quant_rows_per_input(method), R = M * per_input;
    /* chunks and tiles of activation rows; both even, so a split pair never straddles them */
    for (int64_t c = 0; c < R; c += M_CHUNK) {
        const int64_t chunk_end = R - c < M_CHUNK ? R : c + M_CHUNK;
        for (int64_t n = first; n < last; ++n) {
            const uint8_t *wrow = w + n * row_bytes;
            for (int64_t m0 = c; m0 < chunk_end; m0 += ROW_TILE) {
                const int64_t rows = chunk_end - m0 < ROW_TILE ? chunk_end - m0 : ROW_TILE;
                if (method == QUANT_INT8_SPLIT_ACTIVATIONS)
                    split_rows(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, rows);
                else if (method == QUANT_INT8_ACTIVATIONS)
                    int8_rows(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, rows);
                else
                    float_rows(wrow, type, bytes, x, y, N, K, n, m0, rows);
            }
            if (bias != NULL)
                for (int64_t m = c / per_input; m < chunk_end / per_input; ++m)
                    y[m * N + n] += bias[n];
        }
    }
}

#endif
