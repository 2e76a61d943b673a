/*
 * A decode step's reads alone: the ceiling bench/decode_read_ceiling.py measures.
 *
 * The native decoder (kernels/csrc/decoder_cpu.c) splits each stage's bytes between its
 * threads, which meet at a barrier after each stage. This reads the same bytes in the same
 * stages, split the same way, with the same barriers, and does nothing else: each 64-byte
 * line is loaded once a token and xored into a register, on the hardware prefetcher alone.
 * Its rate is what the step's structure allows on this machine's memory with no arithmetic,
 * no attention and no Python.
 *
 *   buffer:      the stages' bytes; stage s starts where stage s - 1's bytes, rounded up to
 *                whole lines, end (64-byte aligned)
 *   sizes[s]:    stage s's bytes
 *   barriers[s]: the barriers after stage s
 *
 * Returns the xor of every 8-byte word read (each token's), so that the reads are not
 * optimized away and a test can check that every line was read.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int tollway_step_reads_abi_version(void) { return 1; }

/* One cache line of words: one AVX-512 register, two AVX2 ones. */
typedef uint64_t Line __attribute__((vector_size(64)));

static void barrier(atomic_llong *arrivals, long long *target, int team) {
    *target += team;
    atomic_fetch_add_explicit(arrivals, 1, memory_order_acq_rel);
    while (atomic_load_explicit(arrivals, memory_order_acquire) < *target) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

static inline Line read_lines(const uint8_t *restrict p, int64_t lines, Line acc) {
    for (int64_t i = 0; i < lines; ++i) {
        Line line;
        memcpy(&line, p + 64 * i, sizeof line);
        acc ^= line;
    }
    return acc;
}

int64_t tollway_step_reads(const uint8_t *buffer, const int64_t *sizes, const int32_t *barriers,
                           int64_t num_stages, int64_t tokens, int num_threads) {
    atomic_llong arrivals = 0;
    uint64_t result = 0;
#pragma omp parallel num_threads(num_threads) reduction(^ : result)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        long long target = 0;
        Line acc = {0};
        for (int64_t token = 0; token < tokens; ++token) {
            int64_t offset = 0;
            for (int64_t s = 0; s < num_stages; ++s) {
                const int64_t lines = (sizes[s] + 63) / 64;
                const int64_t first = lines * thread / team, last = lines * (thread + 1) / team;
                acc = read_lines(buffer + offset + 64 * first, last - first, acc);
                offset += 64 * lines;
                for (int32_t b = 0; b < barriers[s]; ++b) barrier(&arrivals, &target, team);
            }
        }
        for (int i = 0; i < 8; ++i) result ^= acc[i];
    }
    return (int64_t)result;
}
