/*
 * y = x @ W.T + bias for a few rows of x, reading W in oneDNN's packed layout in place.
 *
 * With a handful of rows a linear layer is (nearly) a matrix-vector product: each weight is
 * used once per row, so the time is the time to stream W from memory. oneDNN's kernels
 * (PackedLinear's path) are built for many rows and stay far from the bandwidth there. This
 * kernel streams W once, in storage order, and spends each loaded weight on every row.
 *
 * W is the buffer oneDNN packed it into (torch.ops.mkldnn._reorder_linear_weight); on
 * AVX-512 processors that is blocks of 64 output features, each block k-major:
 *
 *   w:     [ceil(N / 64), k_padded, 64]   w[b][k][j] = W[64 b + j, k]   (k_padded >= K;
 *                                         the padding, k >= K or 64 b + j >= N, is unused)
 *   x:     [M, K] contiguous              y: [M, N] contiguous          bias: [N] or NULL
 *
 * kernels/cpu_linear.py checks that layout once per process (on a small weight of known
 * values) and the buffer's size per weight; PackedLinear then probes each layer through this
 * kernel against F.linear before using it.
 *
 * Work: the blocks are split evenly over OpenMP threads (PyTorch's runtime, as in
 * paged_attention_cpu.c). A pass over a block keeps up to ROWS_PER_PASS rows x 64 outputs of
 * float32 accumulators in registers (24 of the 32 AVX-512 registers); each k-step loads 64
 * weights and spends them on every row of the pass. With more rows than one pass holds, k
 * runs in chunks of K_CHUNK (256 KiB of a block's weights, which stay in L2 for the next
 * pass) and partial sums wait in a per-thread [MAX_ROWS, 64] buffer between chunks.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TOLLWAY_LINEAR_ABI_VERSION 1
#define BLOCK 64 /* output features per packed block */
#define ROWS_PER_PASS 6
#define MAX_ROWS 16
#define K_CHUNK 1024

enum { OK = 0, BAD_ARGUMENTS = 1 };

typedef float v16 __attribute__((vector_size(64)));

int tollway_linear_abi_version(void) { return TOLLWAY_LINEAR_ABI_VERSION; }
int tollway_linear_block(void) { return BLOCK; }
int tollway_linear_max_rows(void) { return MAX_ROWS; }

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* partial[r] (+)= x[r, k0:k1] @ wb[k0:k1] for rows r < R; R is a constant at every call site,
   so the accumulators live in registers. */
static inline __attribute__((always_inline)) void chunk_pass(const float *restrict wb,
                                                             const float *restrict x,
                                                             float partial[][BLOCK], int64_t K,
                                                             int64_t k0, int64_t k1,
                                                             const int R) {
    v16 acc[ROWS_PER_PASS][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = k0 == 0 ? (v16){0} : load16(partial[r] + 16 * j);
    for (int64_t k = k0; k < k1; ++k) {
        const float *wk = wb + k * BLOCK;
        const v16 w0 = load16(wk), w1 = load16(wk + 16), w2 = load16(wk + 32),
                  w3 = load16(wk + 48);
        for (int r = 0; r < R; ++r) {
            const float xr = x[r * K + k];
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
            acc[r][2] += xr * w2;
            acc[r][3] += xr * w3;
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) store16(partial[r] + 16 * j, acc[r][j]);
}

static void chunk_rows(const float *wb, const float *x, float partial[][BLOCK], int64_t M,
                       int64_t K, int64_t k0, int64_t k1) {
    for (int64_t m = 0; m < M; m += ROWS_PER_PASS) {
        const float *xm = x + m * K;
        float(*pm)[BLOCK] = partial + m;
        switch (M - m < ROWS_PER_PASS ? M - m : ROWS_PER_PASS) {
        case 1: chunk_pass(wb, xm, pm, K, k0, k1, 1); break;
        case 2: chunk_pass(wb, xm, pm, K, k0, k1, 2); break;
        case 3: chunk_pass(wb, xm, pm, K, k0, k1, 3); break;
        case 4: chunk_pass(wb, xm, pm, K, k0, k1, 4); break;
        case 5: chunk_pass(wb, xm, pm, K, k0, k1, 5); break;
        default: chunk_pass(wb, xm, pm, K, k0, k1, 6); break;
        }
    }
}

/* One packed block: y[:, o:o + width] = x @ block + bias[o:o + width]. */
static void block_rows(const float *wb, const float *x, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t width) {
    float partial[MAX_ROWS][BLOCK];
    const int64_t chunk = M <= ROWS_PER_PASS ? K : K_CHUNK; /* one pass: no need to split */
    for (int64_t k0 = 0; k0 < K; k0 += chunk)
        chunk_rows(wb, x, partial, M, K, k0, K - k0 < chunk ? K : k0 + chunk);
    for (int64_t m = 0; m < M; ++m) {
        if (bias != NULL)
            for (int64_t j = 0; j < width; ++j) partial[m][j] += bias[j];
        memcpy(y + m * N, partial[m], (size_t)width * sizeof(float));
    }
}

int tollway_small_batch_linear(const float *w, const float *x, const float *bias, float *y,
                               int64_t M, int64_t N, int64_t K, int64_t k_padded,
                               int num_threads) {
    if (M < 0 || M > MAX_ROWS || N < 1 || K < 1 || k_padded < K || num_threads < 1)
        return BAD_ARGUMENTS;
    if (M == 0) return OK; /* an empty tensor's data pointer may be NULL */
    if (w == NULL || x == NULL || y == NULL) return BAD_ARGUMENTS;
    const int64_t num_blocks = (N + BLOCK - 1) / BLOCK;
    const int threads = num_blocks < num_threads ? (int)num_blocks : num_threads;
#pragma omp parallel num_threads(threads)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        const int64_t first = num_blocks * thread / team;
        const int64_t last = num_blocks * (thread + 1) / team;
        for (int64_t b = first; b < last; ++b) {
            const int64_t o = b * BLOCK, width = N - o < BLOCK ? N - o : BLOCK;
            block_rows(w + b * k_padded * BLOCK, x, bias == NULL ? NULL : bias + o, y + o, M, N,
                       K, width);
        }
    }
    return OK;
}
