/*
 * RMSNorm for the CPU, optionally fused with the residual add before it (float32).
 *
 * A decoder layer normalises twice, each time right after adding a sublayer's output to
 * the residual stream. PyTorch's F.rms_norm takes 10-60 us for 1-64 rows of 512 features on
 * the development machine (several passes and dispatches), and the add is one more pass;
 * this is one pass over each row for the sum of squares of the sum, and one to add and
 * scale it (rms_norm_row.h has the formula and the per-row code).
 *
 * Arithmetic is float32 throughout, as in Hugging Face's LlamaRMSNorm for float32 models;
 * only the order of the sum of squares differs (it is vectorised). Rows are spread over
 * OpenMP threads (PyTorch's runtime) once there are enough of them to pay for it.
 */
#include <stdint.h>

#include "rms_norm_row.h"

#define TOLLWAY_NORM_ABI_VERSION 1
#define ROWS_PER_THREAD 32 /* fewer rows than this per thread: one thread does them all */

int tollway_norm_abi_version(void) { return TOLLWAY_NORM_ABI_VERSION; }

/* out, residual, addend: [rows, hidden] contiguous (addend may be NULL); weight: [hidden]. */
void tollway_add_rms_norm(float *out, float *residual, const float *addend, const float *weight,
                          int64_t rows, int64_t hidden, float eps, int num_threads) {
    const int threads = rows >= 2 * ROWS_PER_THREAD ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r)
        norm_row(out + r * hidden, residual + r * hidden,
                 addend == NULL ? NULL : addend + r * hidden, weight, hidden, eps);
}
