/*
 * y = x @ W.T where W [N, K] stays in a GGUF file's quantized blocks (ggml's layouts), on a
 * slice of W's rows: shared by quant_linear_cpu.c (one linear per call) and decoder_cpu.c
 * (every linear of a decode step in one call). quant_linear_cpu.c's header says what the
 * layouts and the two methods are.
 */
#ifndef TOLLWAY_QUANT_LINEAR_ROWS_H
#define TOLLWAY_QUANT_LINEAR_ROWS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define QK 32          /* values per block */
#define ROW_TILE 4     /* rows of x that share one decoded block */
#define M_CHUNK 64     /* rows of x kept hot in cache while a thread walks its outputs */

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 }; /* ggml's type ids */
enum { QUANT_DECODE_TO_FLOAT = 0, QUANT_INT8_ACTIVATIONS = 1 }; /* the method argument */

/* The int8 dot products' instructions: what the compiler targets (-march=native, so this
   processor's). AVX2 alone multiplies pairs to int16 and adds them (no overflow: a pair is at
   most 2 * 128 * 127), as llama.cpp does without VNNI. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define INT8_ISA 2 /* VNNI */
#elif defined(__AVX2__) && defined(__FMA__)
#define INT8_ISA 1 /* AVX2 */
#else
#define INT8_ISA 0 /* plain C */
#endif

typedef float qv16 __attribute__((vector_size(64)));


static inline int64_t quant_block_bytes(int type) {
    switch (type) {
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_1: return 20;
    case TYPE_Q8_0: return 34;
    default: return 0;
    }
}

static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) value = ldexpf((float)mantissa, -24);
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (h & 0x8000) ? -value : value;
#endif
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

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

/* The block's 32 values as two vectors of 16 (values 0-15 and 16-31). */
static inline __attribute__((always_inline)) void decode_block(const uint8_t *block, int type,
                                                               qv16 *first, qv16 *second) {
    const float d = fp16_to_float(block);
    if (type == TYPE_Q8_0) {
        i8x16 q0, q1;
        memcpy(&q0, block + 2, sizeof q0);
        memcpy(&q1, block + 2 + 16, sizeof q1);
        *first = __builtin_convertvector(q0, qv16) * d;
        *second = __builtin_convertvector(q1, qv16) * d;
        return;
    }
    u8x16 q;
    memcpy(&q, block + (type == TYPE_Q4_1 ? 4 : 2), sizeof q);
    const qv16 low = __builtin_convertvector(q & 15, qv16);
    const qv16 high = __builtin_convertvector(q >> 4, qv16);
    if (type == TYPE_Q4_0) {
        *first = (low - 8.0f) * d;
        *second = (high - 8.0f) * d;
    } else {
        const float m = fp16_to_float(block + 2);
        *first = low * d + m;
        *second = high * d + m;
    }
}

/* y[m0 : m0 + rows, n] for one row of W, rows <= ROW_TILE. */
static inline __attribute__((always_inline)) void float_row(const uint8_t *wrow, int type,
                                                            int64_t bytes, const float *x,
                                                            float *y, int64_t N, int64_t K,
                                                            int64_t n, int64_t m0,
                                                            const int rows) {
    qv16 acc[ROW_TILE][2];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < K / QK; ++b) {
        qv16 w0, w1;
        decode_block(wrow + b * bytes, type, &w0, &w1);
        for (int r = 0; r < rows; ++r) {
            const float *xb = x + (m0 + r) * K + b * QK;
            acc[r][0] += w0 * qload16(xb);
            acc[r][1] += w1 * qload16(xb + 16);
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = qsum16(acc[r][0] + acc[r][1]);
}

/* ---- INT8_ACTIVATIONS --------------------------------------------------------------- */

/* x's row as int8 blocks: q[i] = round(x[i] / d), d = max|x| / 127 per block (0 for a zero
   block); dsum[b] = d * sum(q) (Q4_1's min multiplies it). */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *dsum) {
    for (int64_t b = 0; b < K / QK; ++b) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; ++i) {
            const int v = (int)roundf(xb[i] * inverse);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        dsum[b] = scale * (float)sum;
    }
}

#if INT8_ISA > 0
/* Eight int32 sums of four products u * s each (u unsigned, s signed bytes). */
static inline __m256i dpbusd(__m256i unsigned_bytes, __m256i signed_bytes) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned_bytes, signed_bytes);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), unsigned_bytes, signed_bytes);
#else
    const __m256i pairs = _mm256_maddubs_epi16(unsigned_bytes, signed_bytes);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(packed, low4);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    return _mm256_set_m128i(high, low);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void int8_row(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int rows) {
    const int64_t nb = K / QK;
    __m256 acc[ROW_TILE];
    float mins[ROW_TILE] = {0};
    for (int r = 0; r < ROW_TILE; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = wrow + b * bytes;
        const float d = fp16_to_float(block);
        if (type == TYPE_Q4_1) {
            const float m = fp16_to_float(block + 2);
            const __m256i w = nibbles(block + 4);
            for (int r = 0; r < rows; ++r) {
                const int64_t row = (m0 + r) * nb + b;
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * QK));
                const __m256 dot = _mm256_cvtepi32_ps(dpbusd(w, xv));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[row]), acc[r]);
                mins[r] += m * xdsum[row];
            }
        } else {
            const __m256i w = type == TYPE_Q8_0
                                  ? _mm256_loadu_si256((const __m256i *)(block + 2))
                                  : _mm256_sub_epi8(nibbles(block + 2), _mm256_set1_epi8(8));
            const __m256i w_abs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rows; ++r) {
                const int64_t row = (m0 + r) * nb + b;
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * QK));
                const __m256 dot = _mm256_cvtepi32_ps(dpbusd(w_abs, _mm256_sign_epi8(xv, w)));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[row]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = sum8(acc[r]) + mins[r];
}
#else
static inline __attribute__((always_inline)) void int8_row(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int rows) {
    const int64_t nb = K / QK;
    float acc[ROW_TILE] = {0};
    int8_t w[QK];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = wrow + b * bytes;
        const float d = fp16_to_float(block);
        const float m = type == TYPE_Q4_1 ? fp16_to_float(block + 2) : 0.0f;
        if (type == TYPE_Q8_0) {
            memcpy(w, block + 2, QK);
        } else {
            const uint8_t *qs = block + (type == TYPE_Q4_1 ? 4 : 2);
            const int offset = type == TYPE_Q4_0 ? 8 : 0;
            for (int i = 0; i < QK / 2; ++i) {
                w[i] = (int8_t)((qs[i] & 15) - offset);
                w[i + QK / 2] = (int8_t)((qs[i] >> 4) - offset);
            }
        }
        for (int r = 0; r < rows; ++r) {
            const int64_t row = (m0 + r) * nb + b;
            const int8_t *xv = xq + row * QK;
            int32_t dot = 0;
            for (int i = 0; i < QK; ++i) dot += (int32_t)w[i] * (int32_t)xv[i];
            acc[r] += (float)dot * (d * xd[row]) + m * xdsum[row];
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = acc[r];
}
#endif

/* The row functions with the tile's row count a constant, so the accumulators stay in
   registers. */
static void float_rows(const uint8_t *wrow, int type, int64_t bytes, const float *x, float *y,
                       int64_t N, int64_t K, int64_t n, int64_t m0, int64_t rows) {
    switch (rows) {
    case 1: float_row(wrow, type, bytes, x, y, N, K, n, m0, 1); break;
    case 2: float_row(wrow, type, bytes, x, y, N, K, n, m0, 2); break;
    case 3: float_row(wrow, type, bytes, x, y, N, K, n, m0, 3); break;
    default: float_row(wrow, type, bytes, x, y, N, K, n, m0, 4); break;
    }
}

static void int8_rows(const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq,
                      const float *xd, const float *xdsum, float *y, int64_t N, int64_t K,
                      int64_t n, int64_t m0, int64_t rows) {
    switch (rows) {
    case 1: int8_row(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, 1); break;
    case 2: int8_row(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, 2); break;
    case 3: int8_row(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, 3); break;
    default: int8_row(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, 4); break;
    }
}

/* ---- a linear shared by an OpenMP team ------------------------------------------------ */

/* x's rows as int8 blocks (xq [M, K], xd and xdsum [M, K / QK]), the rows split over the
   team: every thread of the team calls it. The caller puts a barrier after it. */
static inline void quant_activations_slice(const float *x, int64_t M, int64_t K, int8_t *xq,
                                           float *xd, float *xdsum, int thread, int team) {
    const int64_t nb = K / QK;
    for (int64_t m = M * thread / team; m < M * (thread + 1) / team; ++m)
        quantize_row(x + m * K, K, xq + m * K, xd + m * nb, xdsum + m * nb);
}

/* y[:, first:last] (+ bias) of y = x @ W.T, W [N, K] of ggml blocks of `type`: the outputs one
   thread owns. INT8_ACTIVATIONS reads xq/xd/xdsum (quant_activations_slice's, all rows);
   DECODE_TO_FLOAT reads x. Each output is one thread's, summed in one fixed order. */
static inline void quant_linear_slice(const uint8_t *w, int type, const float *x,
                                      const int8_t *xq, const float *xd, const float *xdsum,
                                      const float *bias, float *y, int64_t M, int64_t N,
                                      int64_t K, int method, int64_t first, int64_t last) {
    const int64_t bytes = quant_block_bytes(type), row_bytes = K / QK * bytes;
    for (int64_t c = 0; c < M; c += M_CHUNK) {
        const int64_t chunk_end = M - c < M_CHUNK ? M : c + M_CHUNK;
        for (int64_t n = first; n < last; ++n) {
            const uint8_t *wrow = w + n * row_bytes;
            for (int64_t m0 = c; m0 < chunk_end; m0 += ROW_TILE) {
                const int64_t rows = chunk_end - m0 < ROW_TILE ? chunk_end - m0 : ROW_TILE;
                if (method == QUANT_INT8_ACTIVATIONS)
                    int8_rows(wrow, type, bytes, xq, xd, xdsum, y, N, K, n, m0, rows);
                else
                    float_rows(wrow, type, bytes, x, y, N, K, n, m0, rows);
            }
            if (bias != NULL)
                for (int64_t m = c; m < chunk_end; ++m) y[m * N + n] += bias[n];
        }
    }
}

#endif
