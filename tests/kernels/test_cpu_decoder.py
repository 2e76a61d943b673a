"""The native decoder (every layer of a decode step in one call) against plain PyTorch.

The reference below runs the same Llama layers with ``F.rms_norm``, ``F.linear``, the
rotate-half formula, ``F.silu`` and :mod:`kernels.reference`'s paged attention, on copies of
the same caches. ``tests/backend_engine/test_model.py`` checks the decoder inside the model
against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kernels import cpu_decoder, cpu_linear, cpu_quant_linear, reference
from kernels.cpu_decoder import DecoderShape, LayerWeights, NativeDecoder, TokenTables
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.int8_kv_cache import block_scales, int8_cache_shape

pytestmark = pytest.mark.skipif(
    cpu_decoder.native_library() is None or not cpu_linear.is_available(),
    reason="the native kernels cannot be built or oneDNN packs weights another way here",
)

NUM_BLOCKS = 64
BLOCK_SIZE = 8
EPS = 1e-5


@dataclass(frozen=True)
class Dims:
    hidden: int = 96
    intermediate: int = 160
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_layers: int = 3
    bias: bool = False

    @property
    def q(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class RawLayer:  # plain tensors, for the reference
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def raw_layers(dims: Dims, gen: torch.Generator) -> list[RawLayer]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)

    return [
        RawLayer(
            input_norm=norm(),
            qkv=w(dims.q + 2 * dims.kv, dims.hidden),
            qkv_bias=0.1 * torch.randn(dims.q + 2 * dims.kv, generator=gen) if dims.bias else None,
            o=w(dims.hidden, dims.q),
            post_norm=norm(),
            gate_up=w(2 * dims.intermediate, dims.hidden),
            down=w(dims.hidden, dims.intermediate),
        )
        for _ in range(dims.num_layers)
    ]


def blocked(weight: torch.Tensor) -> cpu_linear.BlockedWeight:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    native = cpu_linear.blocked_weight(packed)
    assert native is not None
    return native


def layer_weights(
    raw: RawLayer, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> LayerWeights:
    return LayerWeights(
        input_norm=raw.input_norm,
        qkv=blocked(raw.qkv),
        qkv_bias=raw.qkv_bias,
        o=blocked(raw.o),
        post_norm=raw.post_norm,
        gate_up=blocked(raw.gate_up),
        down=blocked(raw.down),
        key_cache=key_cache,
        value_cache=value_cache,
    )


def build(
    layers: list[RawLayer],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    final_norm: torch.Tensor,
    dims: Dims,
) -> NativeDecoder:
    weights = [
        layer_weights(raw, key_cache, value_cache)
        for raw, (key_cache, value_cache) in zip(layers, caches, strict=True)
    ]
    decoder = NativeDecoder.build(weights, final_norm, shape(dims))
    assert decoder is not None
    return decoder


def shape(dims: Dims) -> DecoderShape:
    return DecoderShape(dims.num_heads, dims.num_kv_heads, dims.head_dim, EPS)


def reference_step(
    layers: list[RawLayer],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    final_norm: torch.Tensor,
    dims: Dims,
    step: Step,
) -> torch.Tensor:  # [num_seqs, hidden]
    num_seqs = step.hidden.shape[0]
    residual = step.hidden.clone()
    cos, sin = step.cos[:, None], step.sin[:, None]  # [num_seqs, 1, head_dim // 2]
    addend: torch.Tensor | None = None
    for raw, (key_cache, value_cache) in zip(layers, caches, strict=True):
        if addend is not None:
            residual = residual + addend
        x = F.rms_norm(residual, (dims.hidden,), raw.input_norm, EPS)
        qkv = F.linear(x, raw.qkv, raw.qkv_bias).view(num_seqs, -1, dims.head_dim)
        qk = qkv[:, : dims.num_heads + dims.num_kv_heads]
        x1, x2 = qk.chunk(2, dim=-1)
        qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        q, k = qk[:, : dims.num_heads], qk[:, dims.num_heads :]
        v = qkv[:, dims.num_heads + dims.num_kv_heads :]
        reference.store_kv(k, v, key_cache, value_cache, step.slots)
        attn = reference.paged_decode_attention(
            q, key_cache, value_cache, step.block_tables, step.seq_lens, dims.head_dim**-0.5
        )
        residual = residual + F.linear(attn.reshape(num_seqs, dims.q), raw.o)
        x = F.rms_norm(residual, (dims.hidden,), raw.post_norm, EPS)
        gate, up = F.linear(x, raw.gate_up).chunk(2, dim=-1)
        addend = F.linear(F.silu(gate) * up, raw.down)
    if addend is not None:
        residual = residual + addend
    return F.rms_norm(residual, (dims.hidden,), final_norm, EPS)


@dataclass(frozen=True)
class Step:
    hidden: torch.Tensor  # [num_seqs, hidden]
    cos: torch.Tensor  # [num_seqs, head_dim // 2]
    sin: torch.Tensor
    slots: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_step(dims: Dims, seq_lens: list[int], gen: torch.Generator) -> Step:
    """One decode token per sequence, each sequence's blocks drawn without replacement."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1  # a spare column, padded
    tables, slots = [], []
    for n in seq_lens:
        table = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        slots.append(table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        tables.append(table + [0] * (width - len(table)))
    angles = torch.rand(len(seq_lens), dims.head_dim // 2, generator=gen) * 6.0
    return Step(
        hidden=torch.randn(len(seq_lens), dims.hidden, generator=gen),
        cos=angles.cos(),
        sin=angles.sin(),
        slots=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def random_caches(dims: Dims, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, dims.num_kv_heads, dims.head_dim)
    return [
        (torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen))
        for _ in range(dims.num_layers)
    ]


def clone(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    return [(k.clone(), v.clone()) for k, v in caches]


def unchanged(
    caches: list[tuple[torch.Tensor, torch.Tensor]], before: list[tuple[torch.Tensor, ...]]
) -> bool:
    return all(
        torch.equal(now, was)
        for pair, was_pair in zip(caches, before, strict=True)
        for now, was in zip(pair, was_pair, strict=True)
    )


def run(decoder: NativeDecoder, step: Step) -> torch.Tensor:
    return decoder(
        step.hidden,
        step.cos[:, None],
        step.sin[:, None],
        step.slots,
        step.block_tables,
        step.seq_lens,
    )


CASES = {
    "one sequence, head_dim 64": (Dims(head_dim=64, num_heads=3, num_kv_heads=1), [37]),
    "mixed contexts": (Dims(), [1, 9, 16, 23]),
    "q/k/v bias (Qwen2)": (Dims(bias=True), [5, 30]),
    "head_dim 128": (Dims(head_dim=128, num_heads=2, num_kv_heads=2, hidden=128), [12, 3, 17]),
    "sixteen sequences": (Dims(num_layers=2), [2 + 3 * i for i in range(16)]),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_step_matches_plain_pytorch(case: str) -> None:
    dims, seq_lens = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    layers = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = random_caches(dims, gen)
    step = make_step(dims, seq_lens, gen)
    want_caches = clone(caches)
    want = reference_step(layers, want_caches, final_norm, dims, step)

    got = run(build(layers, caches, final_norm, dims), step)

    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (key, value), (want_key, want_value) in zip(caches, want_caches, strict=True):
        torch.testing.assert_close(key, want_key, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(value, want_value, atol=1e-4, rtol=1e-4)


def q8_0_weight(rows: int, columns: int, gen: torch.Generator) -> GGUFBlockWeight:
    dense = torch.randn(rows, columns, generator=gen).numpy()
    blocks = quants.quantize(dense, GGMLQuantizationType.Q8_0)
    return GGUFBlockWeight.from_blocks(torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("kind", ["float32", "Q8_0", "Q8_0 tiled"])
@pytest.mark.parametrize("seq_lens", [[37], [1, 9, 16, 23]], ids=["one sequence", "four"])
def test_logits_in_the_same_call_are_the_output_projection_alone(
    kind: str, seq_lens: list[int]
) -> None:
    """A step with the output projection bound returns the same bits as the hidden rows it
    returns without, projected by the one-linear kernel of that weight."""
    dims = Dims()
    vocab = 160  # whole tiles
    gen = torch.Generator().manual_seed(len(kind) + len(seq_lens))
    layers = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = random_caches(dims, gen)
    step = make_step(dims, seq_lens, gen)
    weights = [
        layer_weights(raw, key_cache, value_cache)
        for raw, (key_cache, value_cache) in zip(layers, caches, strict=True)
    ]
    output: cpu_decoder.LinearWeight
    if kind == "float32":
        output = blocked(torch.randn(vocab, dims.hidden, generator=gen))
    else:
        quantized = q8_0_weight(vocab, dims.hidden, gen)
        output = (quantized.tiled_for_kernel() if kind.endswith("tiled") else quantized,)
    decoder = NativeDecoder.build(weights, final_norm, shape(dims), output)
    assert decoder is not None
    assert decoder.output is not None

    hidden = run(decoder, step)  # the step's KV is written again with the same values below
    logits = decoder(
        step.hidden,
        step.cos[:, None],
        step.sin[:, None],
        step.slots,
        step.block_tables,
        step.seq_lens,
        logits=True,
    )

    if isinstance(output, cpu_linear.BlockedWeight):
        want = cpu_linear.small_batch_linear(hidden, output, None)
    else:
        want = cpu_quant_linear.quantized_linear(hidden, output[0])
    assert logits.shape == (len(seq_lens), vocab)
    assert torch.equal(logits, want)


def test_a_decoder_without_an_output_projection_refuses_logits() -> None:
    dims = Dims(num_layers=1)
    gen = torch.Generator().manual_seed(3)
    layers = raw_layers(dims, gen)
    decoder = build(layers, random_caches(dims, gen), torch.ones(dims.hidden), dims)
    step = make_step(dims, [4], gen)
    with pytest.raises(ValueError, match="no output projection"):
        decoder(
            step.hidden,
            step.cos[:, None],
            step.sin[:, None],
            step.slots,
            step.block_tables,
            step.seq_lens,
            logits=True,
        )


def test_a_negative_slot_stores_nothing() -> None:
    dims = Dims(num_layers=1)
    gen = torch.Generator().manual_seed(3)
    layers = raw_layers(dims, gen)
    caches = random_caches(dims, gen)
    before = clone(caches)
    step = make_step(dims, [6], gen)
    step = Step(**{**step.__dict__, "slots": torch.tensor([-1])})
    run(build(layers, caches, torch.ones(dims.hidden), dims), step)
    assert unchanged(caches, before)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("block outside the cache", "outside the KV cache"),
        ("table too short", "shorter than its sequence"),
        ("slot outside the cache", "outside the KV cache"),
    ],
)
def test_bad_tables_are_refused_before_anything_is_written(fault: str, message: str) -> None:
    dims = Dims(num_layers=2)
    gen = torch.Generator().manual_seed(4)
    layers = raw_layers(dims, gen)
    caches = random_caches(dims, gen)
    before = clone(caches)
    step = make_step(dims, [9, 20], gen)
    tables, slots = step.block_tables.clone(), step.slots.clone()
    if fault == "block outside the cache":
        tables[1, 1] = NUM_BLOCKS
    elif fault == "table too short":
        tables = tables[:, :1].contiguous()
    else:
        slots[0] = NUM_BLOCKS * BLOCK_SIZE
    step = Step(**{**step.__dict__, "block_tables": tables, "slots": slots})
    decoder = build(layers, caches, torch.ones(dims.hidden), dims)
    with pytest.raises(ValueError, match=message):
        run(decoder, step)
    assert unchanged(caches, before)


@pytest.mark.parametrize("num_seqs", [0, cpu_decoder.MAX_TOKENS + 1])
def test_batch_sizes_outside_the_kernel_are_refused(num_seqs: int) -> None:
    dims = Dims(num_layers=1)
    gen = torch.Generator().manual_seed(5)
    decoder = build(raw_layers(dims, gen), random_caches(dims, gen), torch.ones(dims.hidden), dims)
    step = make_step(dims, [4] * max(num_seqs, 1), gen)
    rows = slice(0, num_seqs)
    with pytest.raises(ValueError, match="1 to 16 sequences"):
        decoder(
            step.hidden[rows],
            step.cos[rows, None],
            step.sin[rows, None],
            step.slots[rows],
            step.block_tables[rows],
            step.seq_lens[rows],
        )


def test_wrong_metadata_dtypes_are_refused() -> None:
    dims = Dims(num_layers=1)
    gen = torch.Generator().manual_seed(6)
    decoder = build(raw_layers(dims, gen), random_caches(dims, gen), torch.ones(dims.hidden), dims)
    step = make_step(dims, [4], gen)
    step = Step(**{**step.__dict__, "seq_lens": step.seq_lens.long()})
    with pytest.raises(ValueError, match="int metadata"):
        run(decoder, step)


def test_build_declines_what_the_kernel_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    dims = Dims(num_layers=1)
    gen = torch.Generator().manual_seed(7)
    (raw,) = raw_layers(dims, gen)
    ((key_cache, value_cache),) = random_caches(dims, gen)
    weights = layer_weights(raw, key_cache, value_cache)
    norm = torch.ones(dims.hidden)
    assert NativeDecoder.build([weights], norm, shape(dims)) is not None
    bf16_cache = LayerWeights(**{**weights.__dict__, "key_cache": key_cache.bfloat16()})
    wrong_norm = LayerWeights(**{**weights.__dict__, "post_norm": torch.ones(dims.hidden + 1)})
    swapped = LayerWeights(**{**weights.__dict__, "o": weights.down})
    for layer in (bf16_cache, wrong_norm, swapped):
        assert NativeDecoder.build([layer], norm, shape(dims)) is None
    assert NativeDecoder.build([], norm, shape(dims)) is None
    assert NativeDecoder.build([weights], norm, DecoderShape(3, 2, 32, EPS)) is None
    monkeypatch.setattr(cpu_decoder, "native_library", lambda: None)
    assert NativeDecoder.build([weights], norm, shape(dims)) is None


def int8_caches(dims: Dims, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """int8 caches (kernels/int8_kv_cache.py) holding random values and scales."""
    cache_shape = int8_cache_shape(NUM_BLOCKS, BLOCK_SIZE, dims.num_kv_heads, dims.head_dim)
    caches = []
    for _ in range(dims.num_layers):
        pair = []
        for _ in range(2):
            cache = torch.randint(-127, 128, cache_shape, generator=gen, dtype=torch.int8)
            block_scales(cache)[:] = torch.rand(NUM_BLOCKS, dims.num_kv_heads, generator=gen) / 64
            pair.append(cache)
        caches.append((pair[0], pair[1]))
    return caches


@pytest.mark.parametrize("case", ["mixed contexts", "head_dim 128", "sixteen sequences"])
def test_decode_step_on_int8_caches_matches_plain_pytorch(case: str) -> None:
    """The new tokens quantized into their slots by the int8 cache's rules (a block's first
    slot resets its stale scale), attention reading the blocks times their scales."""
    dims, seq_lens = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    layers = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = int8_caches(dims, gen)
    step = make_step(dims, seq_lens, gen)
    want_caches = clone(caches)
    want = reference_step(layers, want_caches, final_norm, dims, step)

    got = run(build(layers, caches, final_norm, dims), step)

    # (a stored value one int8 step apart moves the output by up to ~1e-4)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for (key, value), (want_key, want_value) in zip(caches, want_caches, strict=True):
        for cache, want_cache in ((key, want_key), (value, want_value)):
            # K and V come from matmuls that may differ in the last bits: a value may round
            # one step the other way, a scale move by an ulp or so
            steps = (cache[:, :-1].to(torch.int16) - want_cache[:, :-1].to(torch.int16)).abs()
            assert int(steps.max()) <= 1
            torch.testing.assert_close(block_scales(cache), block_scales(want_cache))


@pytest.mark.parametrize("cache_kind", ["float32", "int8"])
@pytest.mark.parametrize("seq_lens", [[300], [41, 200]], ids=["one long sequence", "two"])
def test_a_step_has_the_same_bits_on_any_number_of_threads(
    cache_kind: str, seq_lens: list[int]
) -> None:
    """A few sequences' attention is shared out in partitions, each thread its own (fetched
    ahead during its q/k/v projection): the bits do not depend on how many threads there are."""
    dims = Dims(num_layers=2)
    gen = torch.Generator().manual_seed(len(seq_lens))
    layers = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = int8_caches(dims, gen) if cache_kind == "int8" else random_caches(dims, gen)
    step = make_step(dims, seq_lens, gen)
    threads_before = torch.get_num_threads()
    results = []
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            own_caches = [(k.clone(), v.clone()) for k, v in caches]
            out = run(build(layers, own_caches, final_norm, dims), step)
            results.append((out, own_caches))
    finally:
        torch.set_num_threads(threads_before)
    (want, want_caches), *others = results
    for out, own_caches in others:
        assert torch.equal(out, want)
        for pair, want_pair in zip(own_caches, want_caches, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(pair, want_pair, strict=True))


def token_decoder(
    dims: Dims,
    layers: list[RawLayer],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    final_norm: torch.Tensor,
    output: cpu_decoder.LinearWeight,
    tables: TokenTables,
) -> NativeDecoder:
    weights = [
        layer_weights(raw, key_cache, value_cache)
        for raw, (key_cache, value_cache) in zip(layers, caches, strict=True)
    ]
    decoder = NativeDecoder.build(weights, final_norm, shape(dims), output, tables)
    assert decoder is not None
    assert decoder.tokens is not None
    return decoder


@pytest.mark.parametrize("embedding_kind", ["float32", "Q8_0 tiled"])
def test_a_run_from_token_ids_is_the_steps_from_their_embeddings(embedding_kind: str) -> None:
    """Each step of a run: the tokens' embedding rows and rotary angles, the layers and the
    output projection, then NumPy's argmax, fed to the next step."""
    dims, vocab, max_positions = Dims(num_layers=2), 160, 64
    gen = torch.Generator().manual_seed(7)
    layers = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = random_caches(dims, gen)
    output = (q8_0_weight(vocab, dims.hidden, gen).tiled_for_kernel(),)
    if embedding_kind == "float32":
        embedding: torch.Tensor | GGUFBlockWeight = torch.randn(vocab, dims.hidden, generator=gen)
        rows = embedding
    else:
        embedding = q8_0_weight(vocab, dims.hidden, gen).tiled_for_kernel()
        rows = cpu_quant_linear.gathered_rows(embedding, torch.arange(vocab))
    angles = torch.arange(max_positions)[:, None] * torch.rand(dims.head_dim // 2, generator=gen)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    tables = TokenTables(embedding, cos_sin)
    seq_lens = [5, 21]
    block_tables = torch.tensor([[3, 4, 0, 0], [7, 8, 9, 10]], dtype=torch.int32)
    num_steps = 3
    lens = torch.tensor([[n + j for n in seq_lens] for j in range(num_steps)], dtype=torch.int32)
    slots = torch.tensor(
        [
            [
                int(block_tables[s, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                for s, n in enumerate(row)
            ]
            for row in lens.tolist()
        ],
        dtype=torch.int64,
    )
    first = torch.tensor([11, 150])

    stepped_caches = clone(caches)
    stepwise = token_decoder(dims, layers, stepped_caches, final_norm, output, tables)
    want, tokens = [], first
    for j in range(num_steps):
        positions = lens[j].long() - 1
        logits = stepwise(
            rows[tokens],
            cos_sin[positions, : dims.head_dim // 2][:, None],
            cos_sin[positions, dims.head_dim // 2 :][:, None],
            slots[j],
            block_tables,
            lens[j],
            logits=True,
        )
        tokens = torch.from_numpy(logits.numpy().argmax(axis=1))
        want.append(tokens)

    got = token_decoder(dims, layers, caches, final_norm, output, tables).decode_run(
        first, slots, block_tables, lens
    )

    assert torch.equal(got, torch.stack(want))
    for pair, want_pair in zip(caches, stepped_caches, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(pair, want_pair, strict=True))


def test_a_runs_argmax_is_the_first_largest_or_the_first_nan() -> None:
    dims, vocab = Dims(num_layers=1), 96
    gen = torch.Generator().manual_seed(8)
    layers = raw_layers(dims, gen)
    caches = random_caches(dims, gen)
    weight = 0.01 * torch.randn(vocab, dims.hidden, generator=gen)
    weight[[20, 70]] = torch.ones(dims.hidden)  # the largest logits, equal: the first wins
    cos_sin = torch.cat([torch.ones(8, dims.head_dim // 2), torch.zeros(8, dims.head_dim // 2)], 1)
    embedding = torch.ones(vocab, dims.hidden)  # every hidden row the same positive row
    tables = TokenTables(embedding, cos_sin)
    final_norm = torch.ones(dims.hidden)
    table = torch.tensor([[1]], dtype=torch.int32)
    lens, slots = torch.tensor([[3]], dtype=torch.int32), torch.tensor([[BLOCK_SIZE + 2]])

    decoder = token_decoder(dims, layers, caches, final_norm, blocked(weight), tables)
    half = dims.head_dim // 2
    logits = decoder(
        embedding[:1],
        cos_sin[2:3, None, :half],
        cos_sin[2:3, None, half:],
        slots[0],
        table,
        lens[0],
        logits=True,
    )[0]
    assert logits[20] == logits[70] == logits.max()  # a tie for the largest
    assert decoder.decode_run(torch.tensor([0]), slots, table, lens).item() == 20

    weight[[55, 90]] = float("nan")  # past the first share on two threads, and later
    decoder = token_decoder(dims, layers, caches, final_norm, blocked(weight), tables)
    assert decoder.decode_run(torch.tensor([0]), slots, table, lens).item() == 55


def test_a_run_refuses_a_token_outside_the_vocabulary() -> None:
    dims, vocab = Dims(num_layers=1), 32
    gen = torch.Generator().manual_seed(9)
    layers = raw_layers(dims, gen)
    tables = TokenTables(
        torch.randn(vocab, dims.hidden, generator=gen), torch.zeros(8, dims.head_dim)
    )
    output = blocked(torch.randn(vocab, dims.hidden, generator=gen))
    decoder = token_decoder(
        dims, layers, random_caches(dims, gen), torch.ones(dims.hidden), output, tables
    )
    table, lens, slots = (
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([[3]], dtype=torch.int32),
        torch.tensor([[BLOCK_SIZE + 2]]),
    )
    with pytest.raises(ValueError, match="a token or a position"):
        decoder.decode_run(torch.tensor([vocab]), slots, table, lens)
    with pytest.raises(ValueError, match="a token or a position"):
        decoder.decode_run(torch.tensor([1]), slots, table, torch.tensor([[9]], dtype=torch.int32))


def q8_0_round_trip(weight: torch.Tensor, tiled: bool) -> tuple[GGUFBlockWeight, torch.Tensor]:
    """weight as Q8_0 blocks for the decoder (tiled or as the file stores them), and the
    float values those blocks hold, for the reference."""
    blocks = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    values = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0).copy())
    quantized = GGUFBlockWeight.from_blocks(
        torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0)
    )
    return (quantized.tiled_for_kernel() if tiled else quantized), values


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "rows"])
@pytest.mark.parametrize("seq_lens", [[37], [1, 9, 16, 23]], ids=["one sequence", "four"])
def test_quantized_layers_match_the_reference_with_the_same_bits_on_any_thread_count(
    tiled: bool, seq_lens: list[int]
) -> None:
    """Layers of Q8_0 blocks: each linear's input is rounded to int8 blocks by the stage that
    writes it (the norms, the attention's combine, SiLU), each thread its own share. The step
    is the dequantized weights' reference within the rounding, and the same bits on 1, 2 and 3
    threads."""
    dims = Dims(num_layers=2)
    gen = torch.Generator().manual_seed(11 + len(seq_lens) + tiled)
    raw = raw_layers(dims, gen)
    final_norm = 1.0 + 0.1 * torch.randn(dims.hidden, generator=gen)
    caches = random_caches(dims, gen)
    step = make_step(dims, seq_lens, gen)
    quantized, dequantized = [], []
    for layer in raw:
        qkv, o, gate_up, down = (
            q8_0_round_trip(w, tiled) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        quantized.append((qkv[0], o[0], gate_up[0], down[0]))
        dequantized.append(
            RawLayer(
                layer.input_norm, qkv[1], layer.qkv_bias, o[1], layer.post_norm, gate_up[1], down[1]
            )
        )
    want_caches = clone(caches)
    want = reference_step(dequantized, want_caches, final_norm, dims, step)

    threads_before = torch.get_num_threads()
    results = []
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            own_caches = clone(caches)
            weights = [
                LayerWeights(
                    input_norm=layer.input_norm,
                    qkv=(qkv,),
                    qkv_bias=layer.qkv_bias,
                    o=(o,),
                    post_norm=layer.post_norm,
                    gate_up=(gate_up,),
                    down=(down,),
                    key_cache=key_cache,
                    value_cache=value_cache,
                )
                for layer, (qkv, o, gate_up, down), (key_cache, value_cache) in zip(
                    raw, quantized, own_caches, strict=True
                )
            ]
            decoder = NativeDecoder.build(weights, final_norm, shape(dims))
            assert decoder is not None
            results.append((run(decoder, step), own_caches))
    finally:
        torch.set_num_threads(threads_before)

    (got, got_caches), *others = results
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    for out, own_caches in others:
        assert torch.equal(out, got)
        for pair, got_pair in zip(own_caches, got_caches, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(pair, got_pair, strict=True))
