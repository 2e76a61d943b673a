/*
 * The split int8 method over TILED weights: W's rows regrouped sixteen at a time so that one
 * AVX-512 register holds sixteen rows' values and one VNNI instruction takes 64 products, one
 * activation word broadcast against sixteen rows. Part of quant_linear_rows.h.
 *
 * Why: the row-at-a-time kernel (quant_int8_rows.h) spends ~20 instructions on each block of
 * 32 values of one row (two fp16 scales read and widened as scalars, a broadcast, a 256-bit
 * dot, a horizontal sum per row), so one decoding sequence was bound by instructions, not by
 * the bytes it reads. A tile spends ~40 on a block of sixteen rows: its scales are one vector
 * conversion, its nibbles unpack once for every activation row, and each output's sum stays
 * in one register lane to the end (no horizontal sums).
 *
 * A tile is 16 rows (out features) of one of the 32-value types Q4_0, Q4_1 or Q8_0; its
 * tile-blocks are in k order, tile-block b holding block b of each of the 16 rows, the same
 * bytes as the file's 16 blocks, regrouped (kernels/quant_tiles.py tiles and untiles them):
 *
 *   fp16 d[16]                 row j's scale
 *   fp16 m[16]                 row j's min (Q4_1 only)
 *   uint8 q[G][16][4]          word (g, j): row j's quant bytes 4g .. 4g + 3 (G = 4 for Q4_0
 *                              and Q4_1, whose byte i holds values i and i + 16 as nibbles;
 *                              G = 8 for Q8_0, stored XOR 0x80, i.e. q + 128, unsigned)
 *
 * So the unsigned values u of a block (nibbles, or Q8_0's q + 128) make eight registers, each
 * four values of every row, and value = d * (u - bias) + m with bias 8 (Q4_0), 128 (Q8_0) or
 * 0 (Q4_1). With x's block as hi + lo / 256 (quantize_row_split), the block's dot is, per row,
 *
 *   d * d_lo * (256 * u.q_hi + u.q_lo - bias * S)  +  m * (dsum_hi + dsum_lo)
 *
 * where S = 256 * sum(q_hi) + sum(q_lo) is x's (isum): exact integers up to the one float
 * multiply-add per block, as split_row's (|256 u.q_hi| <= 256 * 32 * 255 * 127 < 2^31 - 2^30).
 */
#ifndef TOLLWAY_QUANT_TILES_H
#define TOLLWAY_QUANT_TILES_H

#include "quant_blocks.h"

#define TILE_ROWS 16
#define TILE_PREFETCH 2 /* tiles ahead of the one being read to prefetch */
/* A thread's slice of more bytes than this streams on the hardware prefetcher alone, up to its
   last tiles (which prefetch the run read next). Measured on the 2-core development VM, one
   row against weights on huge pages, alternated: slices of 4.4 MB a thread read 1.17x faster
   without the tiles' own prefetches, an output projection of 30 MB of Q8_0 1.12x; slices of
   1.1 MB 1.02x; slices of 276 KB 0.98x, and without them a SmolLM2 decode step (whose layers'
   slices are 100-280 KB) was 0.93-0.96x. In a long stream the software prefetches only take
   the load slots and miss buffers of lines the hardware prefetcher already asked for. */
#define STEADY_PREFETCH_MAX_BYTES (1 << 20)
#define TILED_TYPE 64 /* type | TILED_TYPE: that type's blocks in tiles of TILE_ROWS rows */

/* The bytes a thread reads next, after its slice of a linear (the start of its slice of the
   next linear): its last tiles prefetch these instead of nothing, so that the next linear's
   first tiles are not read cold after the barrier between them. */
typedef struct {
    const uint8_t *start;
    int64_t bytes;
} PrefetchRun;

static const PrefetchRun NO_PREFETCH_RUN = {NULL, 0};

/* Lines a thread reads soon after this linear, elsewhere (the KV blocks of its attention
   work, which comes right after the q/k/v projection): fetched into L2 a few lines per tile
   while the linear streams its tiles, so they are not read cold, one block at a time, with
   the attention's few loads in flight. A decode step of SmolLM2 at ~200 tokens of context:
   1.09-1.11x (paired A/B, three sittings); the attention alone read its KV at ~10 GB/s. */
typedef struct {
    const uint8_t *const *blocks; /* num_blocks runs of block_bytes each */
    int64_t num_blocks, block_bytes;
    int64_t lines_per_tile, next_line; /* the pace, and the lines fetched so far */
} LineDrip;

static inline void drip_lines(LineDrip *drip) {
    const int64_t per_block = drip->block_bytes / 64, total = drip->num_blocks * per_block;
    const int64_t end = drip->next_line + drip->lines_per_tile;
    for (int64_t line = drip->next_line; line < end && line < total; ++line)
        __builtin_prefetch(drip->blocks[line / per_block] + line % per_block * 64, 0, 2); /* T1 */
    drip->next_line = end;
}

static inline int is_tiled_type(int type) { return (type & TILED_TYPE) != 0; }
static inline int untiled_type(int type) { return type & ~TILED_TYPE; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define QUANT_TILES 1

static inline int tileable_type(int type) {
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0;
}

/* Word g (4 int8 values) of an activation block, in all 16 lanes. */
static inline __m512i x_word(const int8_t *block, int g) {
    int32_t word;
    memcpy(&word, block + 4 * g, sizeof word);
    return _mm512_set1_epi32(word);
}

/* y[m0 .. m0 + rows - 1, n0 .. n0 + 15] for one tile (rows <= ROW_TILE rows of x, each with
   its hi and lo int8 rows 2m and 2m + 1 as quant_activations_slice made them). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *tile, const uint8_t *ahead, const int type, const int8_t *xq, const float *xd,
    const float *xdsum, const int32_t *isum, float *y, int64_t N, int64_t nb, int64_t n0,
    int64_t m0, const int rows) {
    const int has_min = type == TYPE_Q4_1;
    const int32_t bias = type == TYPE_Q4_0 ? 8 : type == TYPE_Q8_0 ? 128 : 0;
    const int64_t header = has_min ? 64 : 32;
    const int64_t tile_block = TILE_ROWS * quant_block_bytes(type);
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[ROW_TILE], mins[ROW_TILE];
    for (int r = 0; r < ROW_TILE; ++r) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = tile + b * tile_block;
        /* a later tile's block, a block's work ahead of its use; into L2 (T1), not L1: with
           T0 a SmolLM2 decode step was 1.12x slower (8 of 8 alternated pairs), the L1's few
           miss buffers held by prefetches the loads then waited behind */
        if (ahead != NULL)
            for (int64_t line = 0; line < tile_block; line += 64)
                _mm_prefetch((const char *)ahead + b * tile_block + line, _MM_HINT_T1);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)))
                                 : _mm512_setzero_ps();
        const uint8_t *q = block + header;
        __m512i u[8];
        if (type == TYPE_Q8_0) {
            for (int g = 0; g < 8; ++g) u[g] = _mm512_loadu_si512((const void *)(q + 64 * g));
        } else {
            for (int g = 0; g < 4; ++g) {
                const __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * g));
                u[g] = _mm512_and_si512(packed, low4);
                u[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            }
        }
        for (int r = 0; r < rows; ++r) {
            const int64_t hi = 2 * (m0 + r) * nb + b, lo = hi + nb;
            /* x's words broadcast straight from memory (vpbroadcastd from a load), not through
               general registers: copied as arrays, they were read in pairs into 64-bit
               registers, shifted and moved over one at a time. A Q4_1 tile kernel on weights in
               cache: 1.5x (~49 -> ~74 GB/s on two threads); from DRAM it was already bound by the
               memory, and a SmolLM2 decode step gained ~1%. */
            const int8_t *xh = xq + hi * QK, *xl = xq + lo * QK;
            /* four independent chains of two */
            __m512i h0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], x_word(xh, 0));
            __m512i h1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], x_word(xh, 1));
            __m512i l0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], x_word(xl, 0));
            __m512i l1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], x_word(xl, 1));
            for (int g = 2; g < 8; g += 2) {
                h0 = _mm512_dpbusd_epi32(h0, u[g], x_word(xh, g));
                h1 = _mm512_dpbusd_epi32(h1, u[g + 1], x_word(xh, g + 1));
                l0 = _mm512_dpbusd_epi32(l0, u[g], x_word(xl, g));
                l1 = _mm512_dpbusd_epi32(l1, u[g + 1], x_word(xl, g + 1));
            }
            __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8),
                                           _mm512_add_epi32(l0, l1));
            if (bias != 0)
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(bias * isum[(m0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[lo])), acc[r]);
            if (has_min)
                mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xdsum[hi] + xdsum[lo]), mins[r]);
        }
    }
    for (int r = 0; r < rows; ++r)
        _mm512_storeu_ps(y + (m0 + r) * N + n0, _mm512_add_ps(acc[r], mins[r]));
}

static void tile_rows_of(const uint8_t *tile, const uint8_t *ahead, int type, const int8_t *xq,
                         const float *xd, const float *xdsum, const int32_t *isum, float *y,
                         int64_t N, int64_t nb, int64_t n0, int64_t m0, int64_t rows) {
#define TILE_ROWS_OF(type_id)                                                                  \
    case type_id:                                                                             \
        switch (rows) {                                                                       \
        case 1: tile_rows(tile, ahead, type_id, xq, xd, xdsum, isum, y, N, nb, n0, m0, 1); break;    \
        case 2: tile_rows(tile, ahead, type_id, xq, xd, xdsum, isum, y, N, nb, n0, m0, 2); break;    \
        case 3: tile_rows(tile, ahead, type_id, xq, xd, xdsum, isum, y, N, nb, n0, m0, 3); break;    \
        default: tile_rows(tile, ahead, type_id, xq, xd, xdsum, isum, y, N, nb, n0, m0, 4); break;   \
        }                                                                                     \
        break
    switch (type) {
        TILE_ROWS_OF(TYPE_Q4_0);
        TILE_ROWS_OF(TYPE_Q4_1);
        TILE_ROWS_OF(TYPE_Q8_0);
    }
#undef TILE_ROWS_OF
}

/* y[:, first:last] (+ bias) for a tiled W (first and last multiples of TILE_ROWS), x as the
   split method's int8 rows with their integer sums; the last tiles prefetch `then`, and
   each tile `drip`'s next lines (NULL: none). Each output is one thread's, summed in one
   fixed order. */
static inline void tiled_linear_slice(const uint8_t *w, int type, const int8_t *xq,
                                      const float *xd, const float *xdsum, const int32_t *isum,
                                      const float *bias, float *y, int64_t M, int64_t N,
                                      int64_t K, int64_t first, int64_t last, PrefetchRun then,
                                      LineDrip *drip) {
    const int64_t nb = K / QK, tile_bytes = TILE_ROWS * nb * quant_block_bytes(type);
    const int steady = (last - first) / TILE_ROWS * tile_bytes <= STEADY_PREFETCH_MAX_BYTES;
    for (int64_t c = 0; c < M; c += M_CHUNK) { /* rows of x kept in cache across the tiles */
        const int64_t chunk_end = M - c < M_CHUNK ? M : c + M_CHUNK;
        for (int64_t n0 = first; n0 < last; n0 += TILE_ROWS) {
            const uint8_t *tile = w + n0 / TILE_ROWS * tile_bytes;
            /* the hardware prefetcher stops at every 4 KiB page; a tile is 5-16 KiB. Past
               the slice's end, after the last chunk, the run read next. */
            const int64_t past = (n0 - last) / TILE_ROWS + TILE_PREFETCH; /* tiles past last */
            const uint8_t *ahead = past < 0 ? (steady ? tile + TILE_PREFETCH * tile_bytes : NULL)
                                   : chunk_end == M && (past + 1) * tile_bytes <= then.bytes
                                       ? then.start + past * tile_bytes
                                       : NULL;
            for (int64_t m0 = c; m0 < chunk_end; m0 += ROW_TILE) {
                const int64_t rows = chunk_end - m0 < ROW_TILE ? chunk_end - m0 : ROW_TILE;
                tile_rows_of(tile, m0 == c ? ahead : NULL, type, xq, xd, xdsum, isum, y, N, nb,
                             n0, m0, rows);
            }
            if (bias != NULL)
                for (int64_t m = c; m < chunk_end; ++m)
                    for (int64_t n = n0; n < n0 + TILE_ROWS; ++n) y[m * N + n] += bias[n];
            if (drip != NULL) drip_lines(drip);
        }
    }
}
#else
#define QUANT_TILES 0
static inline int tileable_type(int type) {
    (void)type;
    return 0;
}
#endif

#endif
