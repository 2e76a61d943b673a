/*
 * y = x @ W.T where W [N, K] stays in the GGUF file's quantized blocks (ggml's layouts):
 *
 *   Q8_0 (34 bytes): fp16 d, int8 q[32]                       value q[i] * d
 *   Q4_0 (18 bytes): fp16 d, uint8 qs[16]                     value (nibble - 8) * d
 *   Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16]             value nibble * d + m
 *   Q5_0 (22 bytes): fp16 d, uint32 qh, uint8 qs[16]          value (q5 - 16) * d
 *   Q5_1 (24 bytes): fp16 d, fp16 m, uint32 qh, uint8 qs[16]  value q5 * d + m
 *
 * (nibble i < 16 is qs[i] & 15, nibble i >= 16 is qs[i - 16] >> 4; q5 = nibble | bit i of qh
 * << 4.) The super-block types hold 256 values as eight sub-blocks of 32 (K % 256 == 0):
 *
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]
 *       sub-block j: value (d * sc_j) * q - dmin * m_j, sc_j and m_j 6-bit, packed in scales;
 *       q of sub-blocks 2i and 2i + 1 are the low and high nibbles of qs[32 i .. 32 i + 31].
 *   Q5_K (176 bytes): fp16 d, fp16 dmin, uint8 scales[12], uint8 qh[32], uint8 qs[128]
 *       as Q4_K, plus a fifth bit of q (16) for value l of sub-block j: bit j of qh[l].
 *   Q6_K (210 bytes): uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
 *       value (d * scales[l / 16]) * (q - 32), q 6-bit: four low bits from ql, two from qh
 *       (ggml's dequantize_row_q6_K gives the order).
 *
 *   w: [N, K / block values blocks] raw bytes    x: [M, K] float32    y: [M, N] float32
 *
 * Three ways to spend a block (the method argument; kernels/cpu_quant_linear.py says which is the
 * default and why):
 *   DECODE_TO_FLOAT  decode the block to 32 floats and FMA with x: the dequantized matmul, up
 *                    to summation order.
 *   INT8_ACTIVATIONS quantize x to int8 per block of 32 (scale max|x| / 127, as llama.cpp's
 *                    Q8_0 activations) and take integer dot products (AVX-512 VNNI or AVX-VNNI
 *                    when the compiler targets them, plain C otherwise): W @ x_hat exactly up
 *                    to float rounding, x_hat being x rounded to its int8 grid. (AVX2
 *                    without VNNI: pairwise int16 products; without AVX2: plain C.) A
 *                    super-block's sub-blocks of 32 line up with x's blocks: Q4_K's and
 *                    Q5_K's are Q4_1-like dots with scale d * sc_j and min dmin * m_j; Q6_K's
 *                    16-value scales each weigh half of a dot's int32 lanes.
 *   INT8_SPLIT_ACTIVATIONS  x = hi + lo, both int8 blocks (lo rounds what hi left over): two
 *                    INT8_ACTIVATIONS dots per block sharing one decode of W, ~16-bit
 *                    activations (quant_linear_rows.h).
 *
 * A W of Q4_0, Q4_1 or Q8_0 may also come TILED (type | TILED_TYPE, N % 16 == 0: sixteen rows'
 * blocks regrouped, quant_tiles.h), for the split method only: the fastest form here.
 *
 * tollway_quant_dequantize widens W's rows to float32 (the DECODE_TO_FLOAT decode), for steps
 * of many rows where the caller runs a float32 matmul on cache-sized slices instead;
 * tollway_quant_gather_rows widens chosen rows (an embedding's tokens), tiled or not.
 *
 * Work: output features (rows of W) split evenly over OpenMP threads; each output is computed
 * by one thread in one fixed order, so results are bit-identical for any thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_linear_rows.h"

#define TOLLWAY_QUANT_LINEAR_ABI_VERSION 5

enum { OK = 0, BAD_ARGUMENTS = 1, NO_MEMORY = 2 };

int tollway_quant_linear_abi_version(void) { return TOLLWAY_QUANT_LINEAR_ABI_VERSION; }
int tollway_quant_linear_int8_isa(void) { return INT8_ISA; }

/* ---- entry point -------------------------------------------------------------------- */

int tollway_quant_linear(const uint8_t *w, int type, const float *x, float *y, int64_t M,
                         int64_t N, int64_t K, int method, int num_threads) {
    const int tiled = is_tiled_type(type);
    const int64_t block_values = quant_block_values(untiled_type(type));
    if (block_values == 0 || M < 0 || N < 1 || K < block_values || K % block_values != 0 ||
        num_threads < 1 ||
        (method != QUANT_DECODE_TO_FLOAT && method != QUANT_INT8_ACTIVATIONS &&
         method != QUANT_INT8_SPLIT_ACTIVATIONS) ||
        (tiled && (!QUANT_TILES || !tileable_type(untiled_type(type)) ||
                   method != QUANT_INT8_SPLIT_ACTIVATIONS || N % TILE_ROWS != 0)))
        return BAD_ARGUMENTS;
    if (M == 0) return OK; /* an empty tensor's data pointer may be NULL */
    if (w == NULL || x == NULL || y == NULL) return BAD_ARGUMENTS;
    const int64_t nb = K / QK, R = M * quant_rows_per_input(method); /* int8 rows */
    int8_t *xq = NULL;
    float *xd = NULL, *xdsum = NULL;
    int32_t *isum = NULL;
    if (method != QUANT_DECODE_TO_FLOAT) {
        xq = malloc((size_t)(R * K));
        xd = malloc((size_t)(R * nb) * sizeof(float));
        xdsum = malloc((size_t)(R * nb) * sizeof(float));
        isum = malloc((size_t)(M * nb) * sizeof(int32_t));
        if (xq == NULL || xd == NULL || xdsum == NULL || isum == NULL) {
            free(xq), free(xd), free(xdsum), free(isum);
            return NO_MEMORY;
        }
    }
    /* the outputs are shared in units of a tile's rows for a tiled W */
    const int64_t unit = tiled ? TILE_ROWS : 1, units = N / unit;
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        if (method != QUANT_DECODE_TO_FLOAT) {
            quant_activations_slice(x, M, K, method, xq, xd, xdsum, isum, thread, team);
#pragma omp barrier
        }
        quant_linear_slice(w, type, x, xq, xd, xdsum, isum, NULL, y, M, N, K, method,
                           units * thread / team * unit, units * (thread + 1) / team * unit,
                           NO_PREFETCH_RUN, NULL);
    }
    free(xq), free(xd), free(xdsum), free(isum);
    return OK;
}

int tollway_quant_linear_tiles(void) { return QUANT_TILES; }

/* Rows [n0, n1) of W widened, for one `type` (a constant once inlined: the branches on the type
   leave the loop, which took 3-4x longer with them in). */
static inline __attribute__((always_inline)) void dequantize_rows(const uint8_t *w, int type,
                                                                  float *out, int64_t K,
                                                                  int64_t n0, int64_t n1) {
    const int64_t values = quant_block_values(type), bytes = quant_block_bytes(type);
    const int64_t row_bytes = K / values * bytes;
    const int sub_blocks = (int)(values / QK);
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t b = 0; b < K / values; ++b) {
            const uint8_t *block = w + n * row_bytes + b * bytes;
#pragma GCC unroll 8
            for (int s = 0; s < sub_blocks; ++s) {
                qv16 first, second;
                decode_block(block, type, s, &first, &second);
                float *row = out + n * K + b * values + s * QK;
                memcpy(row, &first, sizeof first);
                memcpy(row + 16, &second, sizeof second);
            }
        }
    }
}

/* W [N, K] widened to float32 rows (out [N, K]), the rows split over the threads: for a step of
   many rows, where one float32 GEMM on the widened weight beats the int8 kernel. */
int tollway_quant_dequantize(const uint8_t *w, int type, float *out, int64_t N, int64_t K,
                             int num_threads) {
    const int64_t values = quant_block_values(type);
    if (values == 0 || N < 1 || K < values || K % values != 0 || num_threads < 1 || w == NULL ||
        out == NULL)
        return BAD_ARGUMENTS;
#pragma omp parallel num_threads(num_threads)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num(), team = omp_get_num_threads();
#endif
        const int64_t n0 = N * thread / team, n1 = N * (thread + 1) / team;
        switch (type) {
        case TYPE_Q4_0: dequantize_rows(w, TYPE_Q4_0, out, K, n0, n1); break;
        case TYPE_Q4_1: dequantize_rows(w, TYPE_Q4_1, out, K, n0, n1); break;
        case TYPE_Q5_0: dequantize_rows(w, TYPE_Q5_0, out, K, n0, n1); break;
        case TYPE_Q5_1: dequantize_rows(w, TYPE_Q5_1, out, K, n0, n1); break;
        case TYPE_Q8_0: dequantize_rows(w, TYPE_Q8_0, out, K, n0, n1); break;
        case TYPE_Q4_K: dequantize_rows(w, TYPE_Q4_K, out, K, n0, n1); break;
        case TYPE_Q5_K: dequantize_rows(w, TYPE_Q5_K, out, K, n0, n1); break;
        case TYPE_Q6_K: dequantize_rows(w, TYPE_Q6_K, out, K, n0, n1); break;
        }
    }
    return OK;
}

/* out[i] = row rows[i] of W [N, K] (type, or a tiled 32-value type) widened to float32, as
   tollway_quant_dequantize widens it: an embedding's tokens, without untiling the rest. */
int tollway_quant_gather_rows(const uint8_t *w, int type, int64_t N, int64_t K,
                              const int64_t *rows, int64_t n, float *out) {
    if (!rows_can_widen(type, N, K) || n < 0 || w == NULL) return BAD_ARGUMENTS;
    for (int64_t i = 0; i < n; ++i)
        if (rows[i] < 0 || rows[i] >= N) return BAD_ARGUMENTS;
    for (int64_t i = 0; i < n; ++i) widen_row(w, type, K, rows[i], out + i * K);
    return OK;
}
