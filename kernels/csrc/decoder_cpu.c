/*
 * Every decoder layer of a decode-only step in one call (float32, CPU).
 *
 * One sequence's decode step reads every weight once, so it should take as long as
 * streaming the weights from memory. Run layer by layer from Python, a Llama step is ~10
 * small operations per layer between its four matmuls (norms, rotary, the KV store,
 * attention, SiLU), each a dispatch, a few checks and an OpenMP fork; on SmolLM2-135M (30
 * thin layers) they cost ~10 ms on top of ~25 ms of matmuls on the 2-core development
 * machine. Here the whole stack is one OpenMP parallel region; the threads meet at a
 * barrier between stages, and the block tables and slots are checked once per step:
 *
 *   residual = embeddings
 *   per layer:  x = norm(residual += previous layer's output)  (no add before layer 0)
 *               qkv = x @ Wqkv (+ bias)
 *               rotate q and k; store k and v in their slots
 *               attn = paged decode attention (q, the layer's cache)
 *               x = norm(residual += attn @ Wo)
 *               act = silu(gate) * up,  [gate | up] = x @ Wgate_up
 *               out = act @ Wdown
 *   hidden = norm(residual += out)                             (the final norm)
 *   logits = hidden @ Woutput                 (when asked for, and the model has one bound)
 *
 * The stages are the same code as the one-operation libraries (linear_rows.h,
 * rms_norm_row.h, rotary_token.h, paged_attention.h), so each gives the same bits as its
 * one-operation call; only silu(gate) * up is here alone, in float32 as in PyTorch.
 *
 * Barriers: a stage whose output a quantized linear reads next (a norm, the attention's
 * combine, SiLU) rounds its own share of that output to int8 blocks as it writes it, so the
 * linear needs no rounding pass and barrier of its own, and each norm is shared by blocks of
 * values (every thread takes its rows' sums of squares): 10 barriers a layer, not 14; a
 * SmolLM2 decode step was 1.01-1.03x faster (paired A/B). A quantized gate/up is shared by
 * matching gate and up rows, so each thread takes SiLU of its own outputs and rounds them for
 * down before the barrier (shared_gate_up): 9 barriers, and no gate/up output read across
 * cores (with the barriers below, 1.037-1.038x). The residual stream alternates
 * between two buffers: the threads read all of one while they write their share of the other.
 * The barriers are the decoder's own (team_barrier): a thread that arrives early fetches its
 * share of the next linear into L2 while it waits, so DRAM is not idle through a stage's
 * imbalance.
 *
 * Memory: the weights are streamed with each thread's next tiles prefetched (quant_tiles.h),
 * and the next linear's first tiles at the end of each. Attention's work items (partitions
 * of one context, or whole sequences) are shared statically (thread_items), and each thread
 * fetches its items' KV blocks into L2 a few lines per tile of the q/k/v projection before
 * them (LineDrip): attention alone read its KV at ~10 GB/s, a block at a time.
 *
 *   hidden, out:           [M, hidden] (M: the step's sequences, 1..LINEAR_MAX_ROWS)
 *   logits:                [M, vocab], or NULL (then out is the step's result)
 *   cos, sin:              [M, head_dim / 2]
 *   slots:                 [M] int64; negative = do not store
 *   block_tables:          [M, max_blocks] int32;  seq_lens: [M] int32 (incl. the new token)
 *   weights:               per linear, oneDNN's packed float32 layout (linear_rows.h), or
 *                          1-3 row segments of ggml blocks as a GGUF file stores them
 *                          (quant_linear_rows.h: a fused q/k/v or gate/up whose shards differ
 *                          in type); biases only on q/k/v
 *   caches:                [num_blocks, block_size, num_kv_heads, head_dim]
 *
 * Returns 0, BAD_ARGUMENTS, BAD_TABLES (a block table or slot outside the cache: nothing is
 * written) or NO_MEMORY.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear_rows.h"
#include "paged_attention.h"
#include "quant_linear_rows.h"
#include "rms_norm_row.h"
#include "rotary_token.h"
#include "row_argmax.h"

#define TOLLWAY_DECODER_ABI_VERSION 7
#define MAX_SEGMENTS 3 /* q, k, v */
#define FLOAT32_PACKED 0 /* a segment type that is not a ggml block type */
#define FLOAT32_ROWS (-1) /* an embedding's type: plain float32 rows [vocab, hidden] */

enum { OK = 0, BAD_ARGUMENTS = 1, BAD_TABLES = 2, NO_MEMORY = 3 };

/* Mirrored by kernels/cpu_decoder.py (_Segment, _Linear, _Layer, _Decoder); their sizes are
   checked at load. A linear's rows are its segments' in order: one FLOAT32_PACKED segment
   (k_padded: in_features as oneDNN padded them), or 1-3 segments of ggml blocks. */
typedef struct {
    const void *data;
    int64_t type, rows;
} WeightSegment;

typedef struct {
    WeightSegment segments[MAX_SEGMENTS];
    int64_t num_segments, k_padded;
} DecoderLinear;

typedef struct {
    const float *input_norm, *qkv_bias, *post_norm;
    DecoderLinear qkv, o, gate_up, down;
    void *key_cache, *value_cache; /* float32, or int8 with a scale row per block */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t num_blocks, block_size; /* block_size: tokens (an int8 block has one row more) */
    int64_t cache_dtype;            /* DTYPE_FLOAT32 or DTYPE_INT8 (paged_attention.h) */
    float eps, scale;
    const DecoderLayer *layers;
    const float *final_norm;
    DecoderLinear output; /* the output projection [vocab, hidden]; no segments: none */
    int64_t vocab;
    /* For steps from token ids (tollway_decode_run); NULL data: none. */
    const void *embedding; /* [vocab, hidden]: FLOAT32_ROWS, or ggml blocks (maybe tiled) */
    int64_t embedding_type;
    const float *cos_sin;  /* [max_positions, head_dim]: cos, then sin, per position */
    int64_t max_positions;
} Decoder;

int tollway_decoder_abi_version(void) { return TOLLWAY_DECODER_ABI_VERSION; }
int64_t tollway_decoder_layer_size(void) { return (int64_t)sizeof(DecoderLayer); }
int64_t tollway_decoder_size(void) { return (int64_t)sizeof(Decoder); }
int tollway_decoder_max_rows(void) { return LINEAR_MAX_ROWS; }

/* x's rows as int8 blocks, for the quantized linears (quant_linear_rows.h). */
typedef struct {
    int8_t *xq;
    float *xd, *xdsum;
    int32_t *isum;
} QuantizedActivations;

/* The team's barrier between stages, which a thread that arrives early spends fetching what it
   reads next into L2 (`ahead`: its share of the next linear), a few lines at a time until the
   last thread arrives. A stage's imbalance (one context's 3 attention partitions on 2 threads,
   the rotary stage of one sequence, the last tiles of a linear) left DRAM idle while the early
   thread waited: a SmolLM2 decode step was 1.00-1.04x faster (paired A/B, four runs). A
   counter that only grows: each barrier completes when it reaches team times the barriers
   passed. A thread kept waiting long (another preempted) yields its core. */
typedef struct {
    atomic_llong *arrivals; /* shared by the team */
    long long target;       /* this thread's: the count that completes its next barrier */
    int team;
    PrefetchRun ahead; /* this thread's next reads, and how far it has fetched them */
    int64_t ahead_fetched;
} TeamSync;

#define AHEAD_MAX_BYTES (512 << 10) /* of a linear's share fetched while waiting: half an L2 */
#define AHEAD_LINES 4               /* per look at the counter (2 and 8 measured the same) */
#define SPINS_BEFORE_YIELD 100000   /* ~1 ms */

/* What this thread reads next: its share of a linear (first_run); fetching resumes where it
   left off while the run is the same. */
static inline void fetch_next(TeamSync *sync, PrefetchRun run) {
    if (run.start != sync->ahead.start) sync->ahead_fetched = 0;
    sync->ahead = run;
}

static void team_barrier(TeamSync *sync) {
    sync->target += sync->team;
    atomic_fetch_add_explicit(sync->arrivals, 1, memory_order_acq_rel);
    const int64_t limit = sync->ahead.bytes < AHEAD_MAX_BYTES ? sync->ahead.bytes : AHEAD_MAX_BYTES;
    for (long spins = 0; atomic_load_explicit(sync->arrivals, memory_order_acquire) < sync->target;
         ++spins) {
        if (sync->ahead_fetched < limit) {
            for (int line = 0; line < AHEAD_LINES; ++line)
                __builtin_prefetch(sync->ahead.start + sync->ahead_fetched + 64 * line, 0, 2);
            sync->ahead_fetched += AHEAD_LINES * 64;
        } else if (spins > SPINS_BEFORE_YIELD) {
            sched_yield();
        } else {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
    }
}

/* The bytes of rows [first, last) of w's segment s onward that lie in segment s (w is
   tiled: [N, K] in segments of whole tiles). */
static PrefetchRun segment_run(const DecoderLinear *w, int64_t s, int64_t first, int64_t last,
                               int64_t K) {
    if (s >= w->num_segments || first >= last) return NO_PREFETCH_RUN;
    int64_t offset = 0;
    for (int64_t i = 0; i < s; ++i) offset += w->segments[i].rows;
    const WeightSegment *segment = &w->segments[s];
    if (first < offset || first >= offset + segment->rows) return NO_PREFETCH_RUN;
    const int type = untiled_type((int)segment->type);
    const int64_t row_bytes = K / quant_block_values(type) * quant_block_bytes(type);
    const int64_t end = last < offset + segment->rows ? last : offset + segment->rows;
    const PrefetchRun run = {(const uint8_t *)segment->data + (first - offset) * row_bytes,
                             (end - first) * row_bytes};
    return run;
}

/* The bytes a tiled w's rows [first, last) begin with: up to the end of their segment (nothing
   for an untiled linear). */
static PrefetchRun rows_run(const DecoderLinear *w, int64_t first, int64_t last, int64_t K) {
    if (!is_tiled_type((int)w->segments[0].type)) return NO_PREFETCH_RUN;
    int64_t s = 0, offset = 0;
    while (s < w->num_segments && first >= offset + w->segments[s].rows)
        offset += w->segments[s++].rows;
    return segment_run(w, s, first, last, K);
}

/* The bytes this thread reads first in linear w ([N, K]) as shared_linear shares it: its
   first tiles, up to the end of their segment (nothing for an untiled linear). */
static PrefetchRun first_run(const DecoderLinear *w, int64_t N, int64_t K) {
    int thread = 0, team = 1;
#ifdef _OPENMP
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    return rows_run(w, N / TILE_ROWS * thread / team * TILE_ROWS,
                    N / TILE_ROWS * (thread + 1) / team * TILE_ROWS, K);
}

/* Whether linear w reads its input as int8 blocks (ggml blocks), not as floats. */
static inline int reads_rounded(const DecoderLinear *w) {
    return w->segments[0].type != FLOAT32_PACKED;
}

/* Blocks [first, last) of x's row m ([M, K]) rounded into q for a linear that reads_rounded. */
static inline void round_blocks(const float *x, int64_t m, int64_t K, int64_t first,
                                int64_t last, const QuantizedActivations *q) {
    quant_activation_blocks(x, m, K, first, last, QUANT_INT8_SPLIT_ACTIVATIONS, q->xq, q->xd,
                            q->xdsum, q->isum);
}

/* Outputs [first, last) of y = x @ W.T (+ bias) for ggml blocks, x already rounded (q), across
   w's segments; the last tiles prefetch `then`. */
static void linear_rows(const DecoderLinear *w, const float *x, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, const QuantizedActivations *q,
                        int64_t first, int64_t last, PrefetchRun then, LineDrip *drip) {
    int64_t offset = 0;
    for (int64_t s = 0; s < w->num_segments; ++s) {
        const WeightSegment *segment = &w->segments[s];
        const int64_t lo = first > offset ? first : offset;
        const int64_t hi = last < offset + segment->rows ? last : offset + segment->rows;
        if (lo < hi)
            quant_linear_slice(segment->data, (int)segment->type, x, q->xq, q->xd, q->xdsum,
                               q->isum, bias == NULL ? NULL : bias + offset, y + offset, M, N, K,
                               QUANT_INT8_SPLIT_ACTIVATIONS, lo - offset, hi - offset,
                               hi == last ? then : segment_run(w, s + 1, hi, last, K), drip);
        offset += segment->rows;
    }
}

/* y = x @ W.T (+ bias), its outputs shared evenly among the team: linear_rows.h's slices for
   a packed float32 weight; for ggml blocks, x rounded to int8 blocks once (unless the stage
   before did: `rounded`), then each thread's range of outputs across the segments. Called by
   every thread, which then wait for each other. Each output is one thread's, in one fixed
   order: any team size, same bits. */
static void shared_linear(const DecoderLinear *w, const float *x, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K, const QuantizedActivations *q,
                          int rounded, PrefetchRun then, LineDrip *drip, TeamSync *sync) {
    int thread = 0, team = 1;
#ifdef _OPENMP
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    if (w->segments[0].type == FLOAT32_PACKED) {
        const int64_t num_slices = linear_num_slices(N);
        linear_slices(w->segments[0].data, x, bias, y, M, N, K, w->k_padded,
                      num_slices * thread / team, num_slices * (thread + 1) / team);
        fetch_next(sync, then);
        team_barrier(sync);
        return;
    }
    if (!rounded) {
        quant_activations_slice(x, M, K, QUANT_INT8_SPLIT_ACTIVATIONS, q->xq, q->xd, q->xdsum,
                                q->isum, thread, team);
        fetch_next(sync, first_run(w, N, K));
        team_barrier(sync);
    }
    /* shared in units of a tile's rows when every segment is tiled (linear_is_valid) */
    const int64_t unit = is_tiled_type((int)w->segments[0].type) ? TILE_ROWS : 1;
    linear_rows(w, x, bias, y, M, N, K, q, N / unit * thread / team * unit,
                N / unit * (thread + 1) / team * unit, then, drip);
    fetch_next(sync, then);
    team_barrier(sync);
}

/* The linear's segments cover exactly N rows of known types; tiled segments (quant_tiles.h)
   are whole tiles, and either every segment is tiled or none is. */
static int linear_is_valid(const DecoderLinear *w, int64_t N, int64_t K) {
    if (w->num_segments < 1 || w->num_segments > MAX_SEGMENTS) return 0;
    if (w->segments[0].type == FLOAT32_PACKED)
        return w->num_segments == 1 && w->segments[0].rows == N && w->k_padded >= K;
    const int tiled = is_tiled_type((int)w->segments[0].type);
    int64_t rows = 0;
    for (int64_t s = 0; s < w->num_segments; ++s) {
        const WeightSegment *segment = &w->segments[s];
        const int type = untiled_type((int)segment->type);
        const int64_t values = quant_block_values(type);
        if (quant_block_bytes(type) == 0 || segment->rows < 1 || values == 0 || K % values != 0)
            return 0;
        if (is_tiled_type((int)segment->type) != tiled ||
            (tiled && (!QUANT_TILES || !tileable_type(type) || segment->rows % TILE_ROWS != 0)))
            return 0;
        rows += segment->rows;
    }
    return rows == N;
}

/* out = norm(sum = residual + addend) for every row (addend NULL: residual), shared among the
   team by blocks of QK values: each thread takes the sum of squares of its rows in full, then
   norms its values and, for a next linear that reads_rounded, rounds them (which saves that
   linear's own rounding and its barrier). sum is not residual: the threads read all of it
   while they write their share of sum. Called by every thread; ends in a barrier. */
static void shared_norm(float *out, float *sum, const float *residual, const float *addend,
                        const float *weight, int64_t M, int64_t H, float eps,
                        const DecoderLinear *next, const QuantizedActivations *q,
                        TeamSync *sync) {
    int thread = 0, team = 1;
#ifdef _OPENMP
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    const int round = next != NULL && reads_rounded(next); /* then H % QK == 0 */
    const int64_t unit = H % QK == 0 ? QK : H, per_row = H / unit;
    const int64_t end = M * per_row * (thread + 1) / team;
    for (int64_t u = M * per_row * thread / team; u < end;) {
        const int64_t m = u / per_row, first = u % per_row;
        const int64_t last = end - m * per_row < per_row ? end - m * per_row : per_row;
        const float *row = residual + m * H, *add = addend == NULL ? NULL : addend + m * H;
        const float inv_rms = norm_inv_rms(norm_sum_of_squares(row, add, H), H, eps);
        norm_values(out + m * H, sum + m * H, row, add, weight, first * unit, last * unit,
                    inv_rms);
        if (round) round_blocks(out, m, H, first * unit / QK, last * unit / QK, q);
        u = m * per_row + last;
    }
    team_barrier(sync);
}

/* act = silu(gate) * up, as PyTorch's F.silu(gate) * up: x / (1 + exp(-x)), then the product. */
#define SILU_PIECE 256 /* a multiple of QK */
__attribute__((optimize("no-fast-math"))) static void silu_mul(float *restrict act,
                                                                const float *restrict gate,
                                                                const float *restrict up,
                                                                int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        act[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* gate/up ([2I, H]: the gate's I rows, then the up's) reads ggml blocks and I is whole blocks:
   then a thread computes matching gate and up outputs (gate_up_share) and their SiLU product
   itself (shared_gate_up). */
static inline int pairs_gate_up(const DecoderLinear *gate_up, int64_t I) {
    return reads_rounded(gate_up) && I % QK == 0;
}

/* This thread's columns [*first, *last) of the I intermediate values, in whole blocks. */
static inline void gate_up_share(int64_t I, int64_t *first, int64_t *last) {
    int thread = 0, team = 1;
#ifdef _OPENMP
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    *first = I / QK * thread / team * QK;
    *last = I / QK * (thread + 1) / team * QK;
}

/* The bytes this thread reads first in gate/up, as the stage after the post-attention norm
   shares it. */
static PrefetchRun gate_up_run(const DecoderLinear *gate_up, int64_t I, int64_t H) {
    if (!pairs_gate_up(gate_up, I)) return first_run(gate_up, 2 * I, H);
    int64_t first, last;
    gate_up_share(I, &first, &last);
    return rows_run(gate_up, first, last, H);
}

/* act = silu(gate) * up, x already rounded for gate/up in q (pairs_gate_up): each thread its
   columns' gate rows [a, b) and up rows [I + a, I + b), then their product and, for a down
   projection that reads_rounded, its blocks into act_q (not q: the others may still read
   that), so that no thread reads another's gate and up
   outputs (read across cores, the 12 KB of one sequence's took microseconds a layer) and no
   barrier stands between the linear and SiLU. Called by every thread; ends in a barrier. */
static void shared_gate_up(const DecoderLinear *w, const float *x, float *gate_up, float *act,
                           int64_t M, int64_t I, int64_t H, const QuantizedActivations *q,
                           const QuantizedActivations *act_q, PrefetchRun then, TeamSync *sync) {
    int64_t a, b;
    gate_up_share(I, &a, &b);
    if (a < b) {
        linear_rows(w, x, NULL, gate_up, M, 2 * I, H, q, a, b, rows_run(w, I + a, I + b, H), NULL);
        linear_rows(w, x, NULL, gate_up, M, 2 * I, H, q, I + a, I + b, then, NULL);
        for (int64_t m = 0; m < M; ++m) {
            silu_mul(act + m * I + a, gate_up + m * 2 * I + a, gate_up + m * 2 * I + I + a, b - a);
            if (act_q != NULL) round_blocks(act, m, I, a / QK, b / QK, act_q);
        }
    }
    fetch_next(sync, then);
    team_barrier(sync);
}

static int slots_are_valid(const int64_t *slots, int64_t M, int64_t num_slots) {
    for (int64_t t = 0; t < M; ++t)
        if (slots[t] >= num_slots) return 0;
    return 1;
}

static int decode_step(const Decoder *d, const float *hidden, float *out, const float *cos,
                       const float *sin, const int64_t *slots, const int32_t *block_tables,
                       const int32_t *seq_lens, int64_t M, int64_t max_blocks, int num_threads,
                       float *logits, int64_t *next_tokens);

int tollway_decode_layers(const Decoder *d, const float *hidden, float *out, const float *cos,
                          const float *sin, const int64_t *slots, const int32_t *block_tables,
                          const int32_t *seq_lens, int64_t M, int64_t max_blocks,
                          int num_threads, float *logits) {
    return decode_step(d, hidden, out, cos, sin, slots, block_tables, seq_lens, M, max_blocks,
                       num_threads, logits, NULL);
}

/* A decode step from token ids: each token's embedding row and its rotary angles at position
   seq_lens - 1 (the decoder's own tables), every layer, the output projection into logits
   ([M, vocab]) and each row's argmax (NumPy's: the first largest, or the first NaN) into
   next_tokens. The threads take the argmax of their own share of the logits. */
static int decode_tokens(const Decoder *d, const int64_t *tokens, const int64_t *slots,
                         const int32_t *block_tables, const int32_t *seq_lens, int64_t M,
                         int64_t max_blocks, int num_threads, float *logits,
                         int64_t *next_tokens) {
    if (d == NULL || d->embedding == NULL || d->cos_sin == NULL || tokens == NULL ||
        logits == NULL || next_tokens == NULL || M < 1 || M > LINEAR_MAX_ROWS)
        return BAD_ARGUMENTS;
    const int64_t H = d->hidden, half = d->head_dim / 2;
    if (d->embedding_type != FLOAT32_ROWS && !rows_can_widen((int)d->embedding_type, d->vocab, H))
        return BAD_ARGUMENTS;
    for (int64_t r = 0; r < M; ++r)
        if (tokens[r] < 0 || tokens[r] >= d->vocab || seq_lens[r] < 1 ||
            seq_lens[r] > d->max_positions)
            return BAD_ARGUMENTS;
    float *rows = malloc((size_t)(M * (2 * H + 2 * half)) * sizeof(float));
    if (rows == NULL) return NO_MEMORY;
    float *hidden = rows, *out = hidden + M * H, *cos = out + M * H, *sin = cos + M * half;
    for (int64_t r = 0; r < M; ++r) {
        if (d->embedding_type == FLOAT32_ROWS)
            memcpy(hidden + r * H, (const float *)d->embedding + tokens[r] * H,
                   (size_t)H * sizeof(float));
        else
            widen_row(d->embedding, (int)d->embedding_type, H, tokens[r], hidden + r * H);
        const float *angles = d->cos_sin + (int64_t)(seq_lens[r] - 1) * d->head_dim;
        memcpy(cos + r * half, angles, (size_t)half * sizeof(float));
        memcpy(sin + r * half, angles + half, (size_t)half * sizeof(float));
    }
    const int status = decode_step(d, hidden, out, cos, sin, slots, block_tables, seq_lens, M,
                                   max_blocks, num_threads, logits, next_tokens);
    free(rows);
    return status;
}

/* A greedy decode run: num_steps steps from token ids (decode_tokens), step j's tokens
   chosen[j] ([num_steps + 1, M]: row 0 given, row j + 1 step j's argmax), its slots slots[j]
   and context lengths seq_lens[j] ([num_steps, M] each), every step into the same block
   tables. One call for the run: in Python between steps, ~30 us a step went to the loop and
   the call, the interpreter's data cold after each step's ~100 MB of weights. Stops at the
   first step that fails, and returns its status. */
int tollway_decode_run(const Decoder *d, int64_t *chosen, const int64_t *slots,
                       const int32_t *block_tables, const int32_t *seq_lens, int64_t num_steps,
                       int64_t M, int64_t max_blocks, int num_threads, float *logits) {
    if (chosen == NULL || slots == NULL || seq_lens == NULL || num_steps < 0)
        return BAD_ARGUMENTS;
    for (int64_t j = 0; j < num_steps; ++j) {
        const int status = decode_tokens(d, chosen + j * M, slots + j * M, block_tables,
                                         seq_lens + j * M, M, max_blocks, num_threads, logits,
                                         chosen + (j + 1) * M);
        if (status != OK) return status;
    }
    return OK;
}

static int decode_step(const Decoder *d, const float *hidden, float *out, const float *cos,
                       const float *sin, const int64_t *slots, const int32_t *block_tables,
                       const int32_t *seq_lens, int64_t M, int64_t max_blocks, int num_threads,
                       float *logits, int64_t *next_tokens) {
    if (d == NULL || M < 1 || M > LINEAR_MAX_ROWS || num_threads < 1 || max_blocks < 0)
        return BAD_ARGUMENTS;
    const DecoderLinear *output = logits != NULL ? &d->output : NULL;
    if ((output != NULL && (d->vocab < 1 || !linear_is_valid(output, d->vocab, d->hidden))) ||
        (next_tokens != NULL && output == NULL))
        return BAD_ARGUMENTS;
    const int64_t H = d->hidden, I = d->intermediate, D = d->head_dim;
    const int64_t Q = d->num_heads * D, KV = d->num_kv_heads * D, QKV = Q + 2 * KV;
    for (int64_t l = 0; l < d->num_layers; ++l) {
        const DecoderLayer *layer = &d->layers[l];
        if (!linear_is_valid(&layer->qkv, QKV, H) || !linear_is_valid(&layer->o, H, Q) ||
            !linear_is_valid(&layer->gate_up, 2 * I, H) || !linear_is_valid(&layer->down, H, I))
            return BAD_ARGUMENTS;
    }
    if (!tables_are_valid(block_tables, seq_lens, M, d->num_blocks, d->block_size, max_blocks) ||
        !slots_are_valid(slots, M, d->num_blocks * d->block_size))
        return BAD_TABLES;
    const AttentionItems items =
        attention_items(seq_lens, M, d->num_heads, d->num_kv_heads, D, d->block_size,
                        max_blocks, d->scale, num_threads);
    const size_t per_thread = attention_buffer_floats(&items);
    const size_t partial_floats = attention_partial_floats(&items, M);
    /* residual (two: one read, one written by each norm), x, sub (a sublayer's output)
       [M, H] | qkv [M, QKV] | attn [M, Q]
       | gate_up [M, 2I] | act [M, I] | attention partials | one attention buffer per thread */
    const size_t step_floats = (size_t)(M * (4 * H + QKV + Q + 3 * I)) + partial_floats;
    float *workspace =
        malloc((step_floats + per_thread * (size_t)num_threads) * sizeof(float));
    /* a linear's input as int8 blocks, hi and lo rows (R = 2M): scales [R, widest / QK] x 2,
       integer sums [M, widest / QK], values [R, widest]; twice, as the down projection's
       input is rounded while gate/up may still read its own (shared_gate_up) */
    const int64_t widest = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    const int64_t R = M * quant_rows_per_input(QUANT_INT8_SPLIT_ACTIVATIONS);
    const size_t scale_floats = (size_t)(2 * R * ((widest + QK - 1) / QK));
    const size_t sum_ints = (size_t)(M * ((widest + QK - 1) / QK));
    const size_t set_bytes =
        (scale_floats * sizeof(float) + sum_ints * sizeof(int32_t) + (size_t)(R * widest) + 63) /
        64 * 64;
    uint8_t *rounded = malloc(2 * set_bytes);
    /* each thread's list of the KV blocks its items read (LineDrip) */
    const int64_t list_length = 2 * M * max_blocks;
    const uint8_t **kv_lists = malloc((size_t)(num_threads * list_length + 1) * sizeof *kv_lists);
    RowBest *shares = next_tokens != NULL ? malloc((size_t)(num_threads * M) * sizeof *shares)
                                          : NULL; /* [thread, row] */
    if (workspace == NULL || rounded == NULL || kv_lists == NULL ||
        (next_tokens != NULL && shares == NULL)) {
        free(workspace), free(rounded), free(kv_lists), free(shares);
        return NO_MEMORY;
    }
    QuantizedActivations sets[2];
    for (int i = 0; i < 2; ++i) {
        float *scales = (float *)(rounded + i * set_bytes);
        int32_t *sums = (int32_t *)(scales + scale_floats);
        sets[i] = (QuantizedActivations){(int8_t *)(sums + sum_ints), scales,
                                         scales + scale_floats / 2, sums};
    }
    const QuantizedActivations quantized = sets[0], quantized_act = sets[1];
    float *residuals = workspace, *x = residuals + 2 * M * H, *sub = x + M * H;
    float *qkv = sub + M * H, *attn = qkv + M * QKV, *gate_up = attn + M * Q;
    float *act = gate_up + M * 2 * I, *partials = act + M * I;
    const int64_t silu_pieces = (I + SILU_PIECE - 1) / SILU_PIECE;
    atomic_llong arrivals = 0; /* the team's barriers (TeamSync) */
#pragma omp parallel num_threads(num_threads)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        float *buffer = workspace + step_floats + per_thread * (size_t)thread;
        int64_t item_first, item_end; /* the attention's items are shared statically */
        thread_items(&items, seq_lens, M, thread, team, &item_first, &item_end);
        const uint8_t **kv_list = kv_lists + thread * list_length;
        LineDrip drip = {kv_list, 0, cache_block_bytes(&items, (int)d->cache_dtype), 0, 0};
        /* the residual stream: read from one buffer, the sum written into the other */
        const float *residual = hidden;
        float *summed = residuals;
        TeamSync sync = {&arrivals, 0, team, NO_PREFETCH_RUN, 0};
        if (d->num_layers > 0) fetch_next(&sync, first_run(&d->layers[0].qkv, QKV, H));
        for (int64_t l = 0; l < d->num_layers; ++l) {
            const DecoderLayer *layer = &d->layers[l];
            shared_norm(x, summed, residual, l == 0 ? NULL : sub, layer->input_norm, M, H, d->eps,
                        &layer->qkv, &quantized, &sync);
            residual = summed;
            summed = summed == residuals ? residuals + M * H : residuals;
            { /* this thread's attention KV, fetched during q/k/v */
                drip.num_blocks = 0;
                for (int64_t item = item_first; item < item_end; ++item)
                    drip.num_blocks += item_cache_blocks(
                        &items, item, seq_lens, block_tables, layer->key_cache,
                        layer->value_cache, (int)d->cache_dtype, kv_list + drip.num_blocks);
                const int64_t tiles = QKV / TILE_ROWS * (thread + 1) / team -
                                      QKV / TILE_ROWS * thread / team;
                const int64_t lines = drip.num_blocks * (drip.block_bytes / 64);
                drip.lines_per_tile = tiles > 0 ? (lines + tiles - 1) / tiles : 0;
                drip.next_line = 0;
            }
            shared_linear(&layer->qkv, x, layer->qkv_bias, qkv, M, QKV, H, &quantized, 1,
                          first_run(&layer->o, H, Q), &drip, &sync);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < M; ++t) {
                float *row = qkv + t * QKV;
                rotate_token(row, cos + t * (D / 2), sin + t * (D / 2),
                             d->num_heads + d->num_kv_heads, D);
                if (slots[t] < 0) continue;
                if (d->cache_dtype == DTYPE_INT8) {
                    store_token_int8(layer->key_cache, layer->value_cache, slots[t], row + Q,
                                     row + Q + KV, d->num_kv_heads, D, d->block_size);
                } else {
                    memcpy((float *)layer->key_cache + slots[t] * KV, row + Q,
                           (size_t)KV * sizeof(float));
                    memcpy((float *)layer->value_cache + slots[t] * KV, row + Q + KV,
                           (size_t)KV * sizeof(float));
                }
            }
            team_barrier(&sync);
            /* each thread its own items: their KV was fetched ahead. A head's output, once
               whole (a sequence's item, or a split step's combined partitions), is rounded
               for o right away where o reads_rounded and heads are whole blocks. */
            const int round_o = reads_rounded(&layer->o) && D % QK == 0;
            for (int64_t item = item_first; item < item_end; ++item) {
                attend_item_caches(&items, item, qkv, QKV, layer->key_cache, layer->value_cache,
                                   DTYPE_FLOAT32, (int)d->cache_dtype, block_tables, seq_lens,
                                   partials, attn, buffer);
                if (round_o && !items.split) round_blocks(attn, item, Q, 0, Q / QK, &quantized);
            }
            team_barrier(&sync);
            if (items.split) {
#pragma omp for schedule(static) nowait
                for (int64_t item = 0; item < M * d->num_heads; ++item) {
                    combine_item(&items, item, seq_lens, partials, DTYPE_FLOAT32, attn);
                    const int64_t h = item % d->num_heads;
                    if (round_o)
                        round_blocks(attn, item / d->num_heads, Q, h * D / QK, (h + 1) * D / QK,
                                     &quantized);
                }
                team_barrier(&sync);
            }
            shared_linear(&layer->o, attn, NULL, sub, M, H, Q, &quantized, round_o,
                          gate_up_run(&layer->gate_up, I, H), NULL, &sync);
            shared_norm(x, summed, residual, sub, layer->post_norm, M, H, d->eps, &layer->gate_up,
                        &quantized, &sync);
            residual = summed;
            summed = summed == residuals ? residuals + M * H : residuals;
            const int round_down = reads_rounded(&layer->down); /* then I % QK == 0 */
            if (pairs_gate_up(&layer->gate_up, I)) {
                shared_gate_up(&layer->gate_up, x, gate_up, act, M, I, H, &quantized,
                               round_down ? &quantized_act : NULL, first_run(&layer->down, H, I),
                               &sync);
            } else {
                shared_linear(&layer->gate_up, x, NULL, gate_up, M, 2 * I, H, &quantized, 1,
                              first_run(&layer->down, H, I), NULL, &sync);
                /* in pieces of SILU_PIECE values (whole blocks), so one sequence's row is
                   shared too; each rounded for down right away where down reads_rounded */
#pragma omp for schedule(static) nowait
                for (int64_t p = 0; p < M * silu_pieces; ++p) {
                    const int64_t r = p / silu_pieces, first = p % silu_pieces * SILU_PIECE;
                    const int64_t n = I - first < SILU_PIECE ? I - first : SILU_PIECE;
                    silu_mul(act + r * I + first, gate_up + r * 2 * I + first,
                             gate_up + r * 2 * I + I + first, n);
                    if (round_down)
                        round_blocks(act, r, I, first / QK, (first + n) / QK, &quantized_act);
                }
                team_barrier(&sync);
            }
            shared_linear(&layer->down, act, NULL, sub, M, H, I, &quantized_act, round_down,
                          l + 1 < d->num_layers ? first_run(&d->layers[l + 1].qkv, QKV, H)
                          : output != NULL      ? first_run(output, d->vocab, H)
                                                : NO_PREFETCH_RUN,
                          NULL, &sync);
        }
        shared_norm(out, summed, residual, d->num_layers > 0 ? sub : NULL, d->final_norm, M, H,
                    d->eps, output, &quantized, &sync);
        if (output != NULL) /* out's rows are all normed and rounded: the norm ends in a barrier */
            shared_linear(output, out, NULL, logits, M, d->vocab, H, &quantized, 1,
                          /* a step from tokens is a run's: the next one starts at layer 0 */
                          next_tokens != NULL && d->num_layers > 0
                              ? first_run(&d->layers[0].qkv, QKV, H)
                              : NO_PREFETCH_RUN,
                          NULL, &sync);
        if (next_tokens != NULL) { /* each thread about its own outputs: still in its cache */
            const int64_t first = d->vocab * thread / team, last = d->vocab * (thread + 1) / team;
            for (int64_t r = 0; r < M; ++r)
                shares[thread * M + r] = best_in(logits + r * d->vocab, first, last);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) next_tokens[r] = argmax_of_shares(shares + r, M, team);
        }
    }
    free(workspace), free(rounded), free(kv_lists), free(shares);
    return OK;
}
