/*
 * ggml's quantized blocks (quant_linear_cpu.c's header gives the layouts): their sizes, and a
 * block decoded to floats (the DECODE_TO_FLOAT method's decode; the int8 method reads them in
 * quant_int8_rows.h). Part of quant_linear_rows.h.
 */
#ifndef TOLLWAY_QUANT_BLOCKS_H
#define TOLLWAY_QUANT_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define QK 32      /* values per block; the super-block types' sub-block; x's int8 block */
#define QK_K 256   /* values per super-block (Q4_K, Q5_K, Q6_K) */
#define ROW_TILE 4 /* rows of x that share one decoded block */

enum { /* ggml's type ids */
    TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8,
    TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14
};

typedef float qv16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

static inline int64_t quant_block_bytes(int type) {
    switch (type) {
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_1: return 20;
    case TYPE_Q5_0: return 22;
    case TYPE_Q5_1: return 24;
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_K: return 144;
    case TYPE_Q5_K: return 176;
    case TYPE_Q6_K: return 210;
    default: return 0;
    }
}

static inline int is_super_block_type(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K;
}

/* Values per block of `type` (K must be a multiple of it); 0 for an unknown type. */
static inline int64_t quant_block_values(int type) {
    if (quant_block_bytes(type) == 0) return 0;
    return is_super_block_type(type) ? QK_K : QK;
}

/* The 6-bit scale and min of Q4_K's and Q5_K's sub-block j, from their 12 packed bytes. */
static inline void k_scale_min(const uint8_t *packed, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
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

/* 16 bytes as 16 floats. GCC compiles __builtin_convertvector from bytes to floats into
   scalar conversions (widening a Q4_1 weight ran at ~1 cycle a value); AVX-512's vpmovzxbd /
   vpmovsxbd widen 16 bytes at once (5.7x faster on one thread), AVX2's 8. */
static inline qv16 u8_to_floats(u8x16 q) {
#if defined(__AVX512F__)
    __m128i bytes;
    memcpy(&bytes, &q, sizeof bytes);
    return (qv16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
    __m128i bytes;
    memcpy(&bytes, &q, sizeof bytes);
    const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
    qv16 out;
    memcpy(&out, halves, sizeof out);
    return out;
#else
    return __builtin_convertvector(q, qv16);
#endif
}

static inline qv16 i8_to_floats(i8x16 q) {
#if defined(__AVX512F__)
    __m128i bytes;
    memcpy(&bytes, &q, sizeof bytes);
    return (qv16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#elif defined(__AVX2__)
    __m128i bytes;
    memcpy(&bytes, &q, sizeof bytes);
    const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
    qv16 out;
    memcpy(&out, halves, sizeof out);
    return out;
#else
    return __builtin_convertvector(q, qv16);
#endif
}

/* 16 * bit i of the little-endian 32 bits at qh (Q5_0's and Q5_1's fifth bits), for values
   0-15 and 16-31: each byte of qh spread over 8 bytes, bit i % 8 of byte i kept. */
static inline void fifth_bits(const uint8_t *qh, u8x16 *first, u8x16 *second) {
    uint64_t spread[4];
    for (int i = 0; i < 4; ++i)
        spread[i] = (qh[i] * 0x0101010101010101ull) & 0x8040201008040201ull;
    u8x16 bits0, bits1;
    memcpy(&bits0, spread, sizeof bits0);
    memcpy(&bits1, spread + 2, sizeof bits1);
    *first = (u8x16)(bits0 != 0) & 16;
    *second = (u8x16)(bits1 != 0) & 16;
}

/* Sub-block s (values 32 s to 32 s + 31) of a super-block as two vectors of 16. */
static inline __attribute__((always_inline)) void decode_sub_block(const uint8_t *block, int type,
                                                                   int s, qv16 *first,
                                                                   qv16 *second) {
    u8x16 q0, q1;
    if (type == TYPE_Q6_K) {
        const int half = s / 4, t = s % 4;
        u8x16 h0, h1;
        memcpy(&q0, block + 64 * half + 32 * (t & 1), sizeof q0);
        memcpy(&q1, block + 64 * half + 32 * (t & 1) + 16, sizeof q1);
        memcpy(&h0, block + 128 + 32 * half, sizeof h0);
        memcpy(&h1, block + 128 + 32 * half + 16, sizeof h1);
        const int shift = 4 * (t >> 1);
        q0 = ((q0 >> shift) & 15) | (((h0 >> (2 * t)) & 3) << 4);
        q1 = ((q1 >> shift) & 15) | (((h1 >> (2 * t)) & 3) << 4);
        const float d = fp16_to_float(block + 208);
        const int8_t *scales = (const int8_t *)(block + 192);
        *first = (u8_to_floats(q0) - 32.0f) * (d * (float)scales[2 * s]);
        *second = (u8_to_floats(q1) - 32.0f) * (d * (float)scales[2 * s + 1]);
        return;
    }
    const uint8_t *qs = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    memcpy(&q0, qs, sizeof q0);
    memcpy(&q1, qs + 16, sizeof q1);
    q0 = (q0 >> shift) & 15;
    q1 = (q1 >> shift) & 15;
    if (type == TYPE_Q5_K) {
        u8x16 h0, h1;
        memcpy(&h0, block + 16, sizeof h0);
        memcpy(&h1, block + 32, sizeof h1);
        q0 |= ((h0 >> s) & 1) << 4;
        q1 |= ((h1 >> s) & 1) << 4;
    }
    int scale, min;
    k_scale_min(block + 4, s, &scale, &min);
    const float d = fp16_to_float(block) * (float)scale;
    const float m = fp16_to_float(block + 2) * (float)min;
    *first = u8_to_floats(q0) * d - m;
    *second = u8_to_floats(q1) * d - m;
}

/* Sub-block s of a block (s = 0 for the 32-value types) as two vectors of 16 (values 0-15 and
   16-31). */
static inline __attribute__((always_inline)) void decode_block(const uint8_t *block, int type,
                                                               int s, qv16 *first,
                                                               qv16 *second) {
    if (is_super_block_type(type)) {
        decode_sub_block(block, type, s, first, second);
        return;
    }
    const float d = fp16_to_float(block);
    if (type == TYPE_Q8_0) {
        i8x16 q0, q1;
        memcpy(&q0, block + 2, sizeof q0);
        memcpy(&q1, block + 2 + 16, sizeof q1);
        *first = i8_to_floats(q0) * d;
        *second = i8_to_floats(q1) * d;
        return;
    }
    const int has_min = type == TYPE_Q4_1 || type == TYPE_Q5_1;
    const int has_fifth_bit = type == TYPE_Q5_0 || type == TYPE_Q5_1;
    u8x16 q;
    memcpy(&q, block + 2 + 2 * has_min + 4 * has_fifth_bit, sizeof q);
    u8x16 low = q & 15, high = q >> 4;
    if (has_fifth_bit) {
        u8x16 fifth_low, fifth_high;
        fifth_bits(block + 2 + 2 * has_min, &fifth_low, &fifth_high);
        low |= fifth_low;
        high |= fifth_high;
    }
    const qv16 first_q = u8_to_floats(low);
    const qv16 second_q = u8_to_floats(high);
    if (has_min) {
        const float m = fp16_to_float(block + 2);
        *first = first_q * d + m;
        *second = second_q * d + m;
    } else {
        const float offset = has_fifth_bit ? 16.0f : 8.0f;
        *first = (first_q - offset) * d;
        *second = (second_q - offset) * d;
    }
}

#endif
