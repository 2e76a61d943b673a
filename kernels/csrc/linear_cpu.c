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
 * Work: the outputs are split evenly over OpenMP threads (PyTorch's runtime, as in
 * paged_attention_cpu.c) in 16-wide slices; linear_rows.h holds the work on a range.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear_rows.h"

#define TOLLWAY_LINEAR_ABI_VERSION 1

enum { OK = 0, BAD_ARGUMENTS = 1 };

int tollway_linear_abi_version(void) { return TOLLWAY_LINEAR_ABI_VERSION; }
int tollway_linear_block(void) { return LINEAR_BLOCK; }
int tollway_linear_max_rows(void) { return LINEAR_MAX_ROWS; }

int tollway_small_batch_linear(const float *w, const float *x, const float *bias, float *y,
                               int64_t M, int64_t N, int64_t K, int64_t k_padded,
                               int num_threads) {
    if (M < 0 || M > LINEAR_MAX_ROWS || N < 1 || K < 1 || k_padded < K || num_threads < 1)
        return BAD_ARGUMENTS;
    if (M == 0) return OK; /* an empty tensor's data pointer may be NULL */
    if (w == NULL || x == NULL || y == NULL) return BAD_ARGUMENTS;
    const int64_t num_slices = linear_num_slices(N);
    const int threads = num_slices < num_threads ? (int)num_slices : num_threads;
#pragma omp parallel num_threads(threads)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        linear_slices(w, x, bias, y, M, N, K, k_padded, num_slices * thread / team,
                      num_slices * (thread + 1) / team);
    }
    return OK;
}
