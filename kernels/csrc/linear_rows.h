/*
 * y = x @ W.T + bias for a few rows of x, W in oneDNN's packed layout: the work on a range
 * of W's blocks, shared by linear_cpu.c (one linear per call) and decoder_cpu.c (every
 * linear of a decode step in one call). linear_cpu.c's header says why and what the
 * layout is:
 *
 *   w:     [ceil(N / 64), k_padded, 64]   w[b][k][j] = W[64 b + j, k]
 *   x:     [M, K] contiguous              y: [M, N] contiguous          bias: [N] or NULL
 *
 * A pass over a block keeps up to LINEAR_ROWS_PER_PASS rows x 64 outputs of float32
 * accumulators in registers (24 of the 32 AVX-512 registers); each k-step loads 64 weights
 * and spends them on every row of the pass. With more rows than one pass holds, k runs in
 * chunks of LINEAR_K_CHUNK (256 KiB of a block's weights, which stay in L2 for the next
 * pass) and partial sums wait in a [LINEAR_MAX_ROWS, 64] buffer between chunks. Each output
 * sums its products in k order whatever the caller, so both libraries agree bit for bit.
 */
#ifndef TOLLWAY_LINEAR_ROWS_H
#define TOLLWAY_LINEAR_ROWS_H

#include <stdint.h>
#include <string.h>

#define LINEAR_BLOCK 64 /* output features per packed block */
#define LINEAR_ROWS_PER_PASS 6
#define LINEAR_MAX_ROWS 16
#define LINEAR_K_CHUNK 1024

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* partial[r][16 c0 : 16 (c0 + V)] (+)= x[r, k0:k1] @ wb[k0:k1, 16 c0 : 16 (c0 + V)] for rows
   r < R; R and V are constants at every call site, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void chunk_pass(const float *restrict wb,
                                                             const float *restrict x,
                                                             float partial[][LINEAR_BLOCK],
                                                             int64_t K, int64_t k0, int64_t k1,
                                                             const int R, const int c0,
                                                             const int V) {
    v16 acc[LINEAR_ROWS_PER_PASS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j)
            acc[r][j] = k0 == 0 ? (v16){0} : load16(partial[r] + 16 * (c0 + j));
    for (int64_t k = k0; k < k1; ++k) {
        const float *wk = wb + k * LINEAR_BLOCK + 16 * c0;
        v16 w[4];
        for (int j = 0; j < V; ++j) w[j] = load16(wk + 16 * j);
        for (int r = 0; r < R; ++r) {
            const float xr = x[r * K + k];
            for (int j = 0; j < V; ++j) acc[r][j] += xr * w[j];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) store16(partial[r] + 16 * (c0 + j), acc[r][j]);
}

/* The rows of a pass, for a whole block (V = 4) or one 16-wide slice of it (V = 1). */
static inline __attribute__((always_inline)) void chunk_pass_rows(
    const float *wb, const float *x, float partial[][LINEAR_BLOCK], int64_t K, int64_t k0,
    int64_t k1, int64_t rows, const int c0, const int V) {
    switch (rows) {
    case 1: chunk_pass(wb, x, partial, K, k0, k1, 1, c0, V); break;
    case 2: chunk_pass(wb, x, partial, K, k0, k1, 2, c0, V); break;
    case 3: chunk_pass(wb, x, partial, K, k0, k1, 3, c0, V); break;
    case 4: chunk_pass(wb, x, partial, K, k0, k1, 4, c0, V); break;
    case 5: chunk_pass(wb, x, partial, K, k0, k1, 5, c0, V); break;
    default: chunk_pass(wb, x, partial, K, k0, k1, 6, c0, V); break;
    }
}

/* Slices [c0, c1) (16 outputs each) of a block, for all M rows, k in [k0, k1). */
static void chunk_rows(const float *wb, const float *x, float partial[][LINEAR_BLOCK], int64_t M,
                       int64_t K, int64_t k0, int64_t k1, int c0, int c1) {
    for (int64_t m = 0; m < M; m += LINEAR_ROWS_PER_PASS) {
        const float *xm = x + m * K;
        float(*pm)[LINEAR_BLOCK] = partial + m;
        const int64_t rows = M - m < LINEAR_ROWS_PER_PASS ? M - m : LINEAR_ROWS_PER_PASS;
        if (c0 == 0 && c1 == 4) {
            chunk_pass_rows(wb, xm, pm, K, k0, k1, rows, 0, 4);
        } else {
            for (int c = c0; c < c1; ++c) {
                switch (c) {
                case 0: chunk_pass_rows(wb, xm, pm, K, k0, k1, rows, 0, 1); break;
                case 1: chunk_pass_rows(wb, xm, pm, K, k0, k1, rows, 1, 1); break;
                case 2: chunk_pass_rows(wb, xm, pm, K, k0, k1, rows, 2, 1); break;
                default: chunk_pass_rows(wb, xm, pm, K, k0, k1, rows, 3, 1); break;
                }
            }
        }
    }
}

/* Slices [c0, c1) of one packed block: y[:, o + 16 c0 : o + min(16 c1, width)] = x @ block
   + bias, where o is the block's first output and width its outputs (< 64 in the last). */
static void linear_block(const float *wb, const float *x, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t width, int c0, int c1) {
    float partial[LINEAR_MAX_ROWS][LINEAR_BLOCK];
    /* one pass: no need to split k */
    const int64_t chunk = M <= LINEAR_ROWS_PER_PASS ? K : LINEAR_K_CHUNK;
    for (int64_t k0 = 0; k0 < K; k0 += chunk)
        chunk_rows(wb, x, partial, M, K, k0, K - k0 < chunk ? K : k0 + chunk, c0, c1);
    const int64_t first = 16 * c0, end = 16 * c1 < width ? 16 * c1 : width;
    for (int64_t m = 0; m < M; ++m) {
        if (bias != NULL)
            for (int64_t j = first; j < end; ++j) partial[m][j] += bias[j];
        memcpy(y + m * N + first, partial[m] + first, (size_t)(end - first) * sizeof(float));
    }
}

#define LINEAR_SLICE 16 /* outputs: the unit work is shared out in */

static inline int64_t linear_num_slices(int64_t N) { return (N + LINEAR_SLICE - 1) / LINEAR_SLICE; }

/* Outputs [16 first, 16 last) of y = x @ W.T + bias (1 <= M <= LINEAR_MAX_ROWS), a range of
   16-wide slices: whole blocks where it covers them, single slices at its ends. Threads
   share a linear out in slices, not blocks, so a 576-output layer (9 blocks) splits evenly
   over two threads. Every output sums its products in k order either way. */
static void linear_slices(const float *w, const float *x, const float *bias, float *y, int64_t M,
                          int64_t N, int64_t K, int64_t k_padded, int64_t first, int64_t last) {
    const int per_block = LINEAR_BLOCK / LINEAR_SLICE;
    for (int64_t s = first; s < last;) {
        const int64_t b = s / per_block, o = b * LINEAR_BLOCK;
        const int c0 = (int)(s % per_block);
        const int c1 = last - b * per_block < per_block ? (int)(last - b * per_block) : per_block;
        const int64_t width = N - o < LINEAR_BLOCK ? N - o : LINEAR_BLOCK;
        linear_block(w + b * k_padded * LINEAR_BLOCK, x, bias == NULL ? NULL : bias + o, y + o, M,
                     N, K, width, c0, c1);
        s = b * per_block + c1;
    }
}

#endif
