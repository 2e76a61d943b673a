/*
 * The INT8_ACTIVATIONS method's row functions: W's blocks against x quantized to int8 per block
 * of 32, with integer dot products. Part of quant_linear_rows.h.
 */
#ifndef TOLLWAY_QUANT_INT8_ROWS_H
#define TOLLWAY_QUANT_INT8_ROWS_H

#include "quant_blocks.h"

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
/* acc plus eight int32 sums of four products u * s each (u unsigned, s signed bytes). */
static inline __m256i dpbusd_add(__m256i acc, __m256i unsigned_bytes, __m256i signed_bytes) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, unsigned_bytes, signed_bytes);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, unsigned_bytes, signed_bytes);
#else
    const __m256i pairs = _mm256_maddubs_epi16(unsigned_bytes, signed_bytes);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

static inline __m256i dpbusd(__m256i unsigned_bytes, __m256i signed_bytes) {
    return dpbusd_add(_mm256_setzero_si256(), unsigned_bytes, signed_bytes);
}

static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(packed, low4);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    return _mm256_set_m128i(high, low);
}

/* Byte i = 16 if bit i of the little-endian 32 bits at qh is set, else 0 (Q5_0's and Q5_1's
   fifth bits, in nibbles()'s value order). */
static inline __m256i fifth_bit_bytes(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8( /* byte i = byte i / 8 of bits */
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201); /* 1 << i % 8 */
    const __m256i is_set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(is_set, _mm256_set1_epi8(16));
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
        if (type == TYPE_Q4_1 || type == TYPE_Q5_1) {
            const float m = fp16_to_float(block + 2);
            const __m256i w = type == TYPE_Q4_1
                                  ? nibbles(block + 4)
                                  : _mm256_or_si256(nibbles(block + 8), fifth_bit_bytes(block + 4));
            for (int r = 0; r < rows; ++r) {
                const int64_t row = (m0 + r) * nb + b;
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * QK));
                const __m256 dot = _mm256_cvtepi32_ps(dpbusd(w, xv));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[row]), acc[r]);
                mins[r] += m * xdsum[row];
            }
        } else {
            const __m256i w =
                type == TYPE_Q8_0   ? _mm256_loadu_si256((const __m256i *)(block + 2))
                : type == TYPE_Q4_0 ? _mm256_sub_epi8(nibbles(block + 2), _mm256_set1_epi8(8))
                                    : _mm256_sub_epi8(_mm256_or_si256(nibbles(block + 6),
                                                                      fifth_bit_bytes(block + 2)),
                                                      _mm256_set1_epi8(16));
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
/* One block of a 32-value type against x's hi and lo rows (quantize_row_split: lo's scale is
   hi's / 256) as ONE integer sum, hi * 256 + lo (at most 32 * 127 * 127 * 257 < 2^31), so the
   block costs one conversion and one multiply-add however x was split. */
static inline __attribute__((always_inline)) __m256 split_block(
    const uint8_t *block, int type, const int8_t *xq, const float *xd, const float *xdsum,
    int64_t hi, int64_t lo, __m256 acc, float *min_sum) {
    const float d = fp16_to_float(block);
    __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + hi * QK));
    __m256i xl = _mm256_loadu_si256((const __m256i *)(xq + lo * QK));
    __m256i u;
    if (type == TYPE_Q4_1 || type == TYPE_Q5_1) {
        u = type == TYPE_Q4_1 ? nibbles(block + 4)
                              : _mm256_or_si256(nibbles(block + 8), fifth_bit_bytes(block + 4));
        *min_sum += fp16_to_float(block + 2) * (xdsum[hi] + xdsum[lo]);
    } else {
        const __m256i w =
            type == TYPE_Q8_0   ? _mm256_loadu_si256((const __m256i *)(block + 2))
            : type == TYPE_Q4_0 ? _mm256_sub_epi8(nibbles(block + 2), _mm256_set1_epi8(8))
                                : _mm256_sub_epi8(_mm256_or_si256(nibbles(block + 6),
                                                                  fifth_bit_bytes(block + 2)),
                                                  _mm256_set1_epi8(16));
        u = _mm256_sign_epi8(w, w);
        xh = _mm256_sign_epi8(xh, w);
        xl = _mm256_sign_epi8(xl, w);
    }
    const __m256i sum = dpbusd_add(_mm256_slli_epi32(dpbusd(u, xh), 8), u, xl);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * xd[lo]), acc);
}

/* The split method for the 32-value types: y[m0 + p, n] for x's rows m0 .. m0 + pairs - 1, whose
   hi and lo int8 rows are activation rows 2m and 2m + 1. Two accumulators per row (even and odd
   blocks), so consecutive blocks' multiply-adds do not wait on each other. */
static inline __attribute__((always_inline)) void split_row(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int pairs) {
    const int64_t nb = K / QK;
    __m256 even[ROW_TILE / 2], odd[ROW_TILE / 2];
    float even_mins[ROW_TILE / 2] = {0}, odd_mins[ROW_TILE / 2] = {0};
    for (int p = 0; p < pairs; ++p) even[p] = odd[p] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        for (int p = 0; p < pairs; ++p) {
            const int64_t hi = 2 * (m0 + p) * nb + b, lo = hi + nb;
            even[p] = split_block(wrow + b * bytes, type, xq, xd, xdsum, hi, lo, even[p],
                                  &even_mins[p]);
            odd[p] = split_block(wrow + (b + 1) * bytes, type, xq, xd, xdsum, hi + 1, lo + 1,
                                 odd[p], &odd_mins[p]);
        }
    }
    for (; b < nb; ++b) {
        for (int p = 0; p < pairs; ++p) {
            const int64_t hi = 2 * (m0 + p) * nb + b, lo = hi + nb;
            even[p] = split_block(wrow + b * bytes, type, xq, xd, xdsum, hi, lo, even[p],
                                  &even_mins[p]);
        }
    }
    for (int p = 0; p < pairs; ++p)
        y[(m0 + p) * N + n] = sum8(_mm256_add_ps(even[p], odd[p])) + (even_mins[p] + odd_mins[p]);
}

/* Q4_K's and Q5_K's eight sub-block scales (d * scale_j) and mins (dmin * min_j) as vectors:
   k_scale_min for all eight at once, on 32-bit words of the 12 packed bytes. */
static inline void k_scales_mins(const uint8_t *block, __m256 *scales, __m256 *mins) {
    uint32_t packed[3];
    memcpy(packed, block + 4, sizeof packed);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const __m128i bytes = _mm_setr_epi32(
        (int)(packed[0] & low6),                                              /* scales 0-3 */
        (int)((packed[2] & low4) | (((packed[0] >> 6) & top2) << 4)),         /* scales 4-7 */
        (int)(packed[1] & low6),                                              /* mins 0-3 */
        (int)(((packed[2] >> 4) & low4) | (((packed[1] >> 6) & top2) << 4))); /* mins 4-7 */
    *scales = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(block)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    *mins = _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(block + 2)),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
}

/* Q4_K and Q5_K: sub-block j's value is (d * scale_j) * q - dmin * min_j with q unsigned, so
   each sub-block is a Q4_1-like dot against one activation block. */
static inline __attribute__((always_inline)) void int8_row_q45k(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int rows) {
    const int64_t nb = K / QK;
    const __m256i low4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    __m256 acc[ROW_TILE], mins[ROW_TILE];
    for (int r = 0; r < ROW_TILE; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t *block = wrow + sb * bytes;
        __m256 scales, block_mins; /* d * scale_j and dmin * min_j, j = 0..7 */
        k_scales_mins(block, &scales, &block_mins);
        __m256 row_scales[ROW_TILE]; /* scales times x's block scales */
        for (int r = 0; r < rows; ++r) {
            const int64_t first = (m0 + r) * nb + sb * 8;
            row_scales[r] = _mm256_mul_ps(scales, _mm256_loadu_ps(xd + first));
            mins[r] = _mm256_fmadd_ps(block_mins, _mm256_loadu_ps(xdsum + first), mins[r]);
        }
        const uint8_t *qs = block + (type == TYPE_Q5_K ? 48 : 16);
        __m256i fifth = type == TYPE_Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16))
                                          : _mm256_setzero_si256();
        for (int pair = 0; pair < 4; ++pair) { /* sub-blocks 2 pair (low nibbles), 2 pair + 1 */
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * pair));
            __m256i w0 = _mm256_and_si256(packed, low4);
            __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            if (type == TYPE_Q5_K) { /* bit 2 pair and 2 pair + 1 of each qh byte */
                w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_slli_epi16(fifth, 4), bit4));
                w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_slli_epi16(fifth, 3), bit4));
                fifth = _mm256_srli_epi16(fifth, 2);
            }
            for (int r = 0; r < rows; ++r) {
                const int64_t row = (m0 + r) * nb + sb * 8 + 2 * pair;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + row * QK));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + row * QK + QK));
                const __m256 scale0 = _mm256_permutevar8x32_ps(
                    row_scales[r], _mm256_set1_epi32(2 * pair));
                const __m256 scale1 = _mm256_permutevar8x32_ps(
                    row_scales[r], _mm256_set1_epi32(2 * pair + 1));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dpbusd(w0, x0)), scale0, acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dpbusd(w1, x1)), scale1, acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = sum8(acc[r]) - sum8(mins[r]);
}

/* Q6_K: value (d * scale) * (q - 32), a scale per 16 values: an activation block's dot takes
   two scales, its four low int32 lanes (values 0-15) one and the four high lanes the other. */
static inline __attribute__((always_inline)) void int8_row_q6k(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int rows) {
    (void)type, (void)xdsum; /* Q6_K has no min */
    const int64_t nb = K / QK;
    const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
    const __m256i offset = _mm256_set1_epi8(32);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t *block = wrow + sb * bytes;
        const float d = fp16_to_float(block + 208);
        const int8_t *scales = (const int8_t *)(block + 192);
        for (int half = 0; half < 2; ++half) { /* 128 values: ql[64 half ...], qh[32 half ...] */
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(block + 64 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(block + 64 * half + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half));
            __m256i w[4];
            w[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
            w[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
            w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                   _mm256_and_si256(qh, high2));
            w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
            const __m256 half_scales = _mm256_mul_ps( /* d * scales[8 half ... 8 half + 7] */
                _mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                       (const __m128i *)(scales + 8 * half)))));
            for (int t = 0; t < 4; ++t) {
                const int s = 4 * half + t; /* the sub-block of 32 */
                const __m256i ws = _mm256_sub_epi8(w[t], offset);
                const __m256i ws_abs = _mm256_sign_epi8(ws, ws);
                const __m256 scale = _mm256_permutevar8x32_ps( /* scale 2 t, 4 lanes; 2 t + 1 */
                    half_scales, _mm256_set_epi32(2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1,
                                                  2 * t, 2 * t, 2 * t, 2 * t));
                for (int r = 0; r < rows; ++r) {
                    const int64_t row = (m0 + r) * nb + sb * 8 + s;
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + row * QK));
                    const __m256 dot =
                        _mm256_cvtepi32_ps(dpbusd(ws_abs, _mm256_sign_epi8(xv, ws)));
                    acc[r] = _mm256_fmadd_ps(
                        dot, _mm256_mul_ps(scale, _mm256_set1_ps(xd[row])), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = sum8(acc[r]);
}
#else
/* W's 32-value block b as integers: value i = w[i] * scale[i / 16] + offset. */
static inline void int8_block(const uint8_t *wrow, int type, int64_t bytes, int64_t b,
                              int8_t w[QK], float scale[2], float *offset) {
    *offset = 0.0f;
    if (is_super_block_type(type)) {
        const uint8_t *block = wrow + b / (QK_K / QK) * bytes;
        const int s = (int)(b % (QK_K / QK));
        if (type == TYPE_Q6_K) {
            const int half = s / 4, t = s % 4;
            const uint8_t *ql = block + 64 * half + 32 * (t & 1), *qh = block + 128 + 32 * half;
            for (int i = 0; i < QK; ++i)
                w[i] = (int8_t)((((ql[i] >> (4 * (t >> 1))) & 15) | (((qh[i] >> (2 * t)) & 3) << 4)) -
                                32);
            const float d = fp16_to_float(block + 208);
            const int8_t *scales = (const int8_t *)(block + 192);
            scale[0] = d * (float)scales[2 * s];
            scale[1] = d * (float)scales[2 * s + 1];
            return;
        }
        const uint8_t *qs = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (s / 2);
        for (int i = 0; i < QK; ++i) {
            int q = (qs[i] >> (4 * (s & 1))) & 15;
            if (type == TYPE_Q5_K) q |= ((block[16 + i] >> s) & 1) << 4;
            w[i] = (int8_t)q;
        }
        int sub_scale, sub_min;
        k_scale_min(block + 4, s, &sub_scale, &sub_min);
        scale[0] = scale[1] = fp16_to_float(block) * (float)sub_scale;
        *offset = -(fp16_to_float(block + 2) * (float)sub_min);
        return;
    }
    const uint8_t *block = wrow + b * bytes;
    scale[0] = scale[1] = fp16_to_float(block);
    if (type == TYPE_Q8_0) {
        memcpy(w, block + 2, QK);
        return;
    }
    const int has_min = type == TYPE_Q4_1 || type == TYPE_Q5_1;
    const int has_fifth_bit = type == TYPE_Q5_0 || type == TYPE_Q5_1;
    const int bias = has_min ? 0 : (has_fifth_bit ? 16 : 8);
    const uint8_t *qs = block + 2 + 2 * has_min + 4 * has_fifth_bit;
    uint32_t fifth = 0;
    if (has_fifth_bit) memcpy(&fifth, block + 2 + 2 * has_min, sizeof fifth);
    for (int i = 0; i < QK / 2; ++i) {
        w[i] = (int8_t)(((qs[i] & 15) | ((fifth >> i) & 1) << 4) - bias);
        w[i + QK / 2] = (int8_t)(((qs[i] >> 4) | ((fifth >> (i + 16)) & 1) << 4) - bias);
    }
    if (has_min) *offset = fp16_to_float(block + 2);
}

static inline __attribute__((always_inline)) void int8_row(
    const uint8_t *wrow, int type, int64_t bytes, const int8_t *xq, const float *xd,
    const float *xdsum, float *y, int64_t N, int64_t K, int64_t n, int64_t m0, const int rows) {
    const int64_t nb = K / QK;
    float acc[ROW_TILE] = {0};
    int8_t w[QK];
    float scale[2], offset;
    for (int64_t b = 0; b < nb; ++b) {
        int8_block(wrow, type, bytes, b, w, scale, &offset);
        for (int r = 0; r < rows; ++r) {
            const int64_t row = (m0 + r) * nb + b;
            const int8_t *xv = xq + row * QK;
            int32_t dot0 = 0, dot1 = 0;
            for (int i = 0; i < QK / 2; ++i) dot0 += (int32_t)w[i] * (int32_t)xv[i];
            for (int i = QK / 2; i < QK; ++i) dot1 += (int32_t)w[i] * (int32_t)xv[i];
            if (scale[0] == scale[1])
                acc[r] += (float)(dot0 + dot1) * (scale[0] * xd[row]) + offset * xdsum[row];
            else
                acc[r] += (float)dot0 * (scale[0] * xd[row]) + (float)dot1 * (scale[1] * xd[row]);
        }
    }
    for (int r = 0; r < rows; ++r) y[(m0 + r) * N + n] = acc[r];
}
#endif

#if INT8_ISA == 0 /* plain C: one row function reads every type */
#define int8_row_q45k int8_row
#define int8_row_q6k int8_row
#endif

#endif
