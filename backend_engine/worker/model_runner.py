"""Runs one scheduled step on the model: builds the packed batch, owns the KV
cache tensors and the per-request random generators, and samples.

Sampling sees each row after its logit bias and penalties (:mod:`.logits_processing`) and its
grammar's mask, greedy choice and logprobs alike. A prefill chunk of a request that asks for
prompt logprobs also has its positions' logits computed (:mod:`.prompt_logprobs`): the
model's own, before any of that.

A failure is pinned on the requests that cause it (:mod:`.failure_isolation`): the step
comes back with their exceptions, and every other request's token, the same token it
would have got without them.

The choices of an ``n`` > 1 request share one prefill: the step that ends the leader's
prompt samples each pending choice (``ScheduledRequest.forks``) from the leader's logits row,
copied into a sample row of its own (its own settings, generator and matcher), and the next
step first copies the KV blocks the scheduler asks for (``SchedulerOutput.block_copies``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from backend_engine.config import EngineConfig
from backend_engine.core.kv_cache_manager import BlockCopy
from backend_engine.core.scheduler import ScheduledRequest, SchedulerOutput
from backend_engine.core.step_runner import DraftRowCost, RunnerOutput, SampledToken
from backend_engine.model_loader.weights import resolve_dtype
from backend_engine.models import load_model
from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.packed_linear import pack_linears
from backend_engine.models.quantized_linear import move_blocks_to_huge_pages
from backend_engine.outputs import TokenLogprob
from backend_engine.worker.cpu_runtime import tune_cpu_runtime
from backend_engine.worker.decode_run import run_decodes
from backend_engine.worker.draft_row_cost import measure_draft_row_cost
from backend_engine.worker.draft_verification import verify_drafts
from backend_engine.worker.failure_isolation import isolate_failures
from backend_engine.worker.logits_mask import accept_tokens, mask_logits
from backend_engine.worker.logits_processing import apply_logits_stage
from backend_engine.worker.prompt_logprobs import chunk_prompt_logprobs, owes_prompt_logprobs
from backend_engine.worker.sampler import choose_tokens, token_logprobs
from kernels.huge_pages import huge_page_empty, release_freed_memory
from kernels.int8_kv_cache import int8_bytes_per_block, int8_cache_shape
from model_files.checkpoint import Checkpoint
from model_files.model_config import ModelConfig


def engine_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """The dtype weights and KV cache use: the configured one, except float16 on CPU."""
    dtype = resolve_dtype(config.dtype, model_config)
    if config.device == "cpu" and dtype == torch.float16:
        return torch.float32  # half matmuls on CPU are slow and inexact
    return dtype


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one block across every layer's K and V: ``dtype`` elements, or an int8
    cache's values and its per-head scales (:mod:`kernels.int8_kv_cache`)."""
    kv_heads, head_dim = model_config.num_key_value_heads, model_config.head_dim
    if kv_cache_dtype == "int8":
        per_layer = 2 * int8_bytes_per_block(block_size, kv_heads, head_dim)
    else:
        element_size = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * kv_heads * head_dim * element_size * block_size
    return per_layer * model_config.num_hidden_layers


def prepare_for_cpu(model: torch.nn.Module) -> None:
    """A loaded model's weights in their fastest CPU forms: float linears prepacked for
    oneDNN; GGUF blocks on huge pages (a decode step streams them: kernels.huge_pages), their
    old copies' memory back to the system."""
    pack_linears(model)
    if move_blocks_to_huge_pages(model):
        release_freed_memory()


def allocate_kv_caches(
    config: EngineConfig, model_config: ModelConfig, num_blocks: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer, of ``dtype`` or int8 as configured:
    [num_blocks, block_size (+ 1 scale row if int8), num_kv_heads, head_dim]; on huge pages
    on the CPU (:mod:`kernels.huge_pages`: decode streams the cache)."""
    kv_heads, head_dim = model_config.num_key_value_heads, model_config.head_dim
    if config.kv_cache_dtype == "int8":
        shape = int8_cache_shape(num_blocks, config.block_size, kv_heads, head_dim)
        dtype = torch.int8
    else:
        shape = (num_blocks, config.block_size, kv_heads, head_dim)
    layers = model_config.num_hidden_layers
    if torch.device(config.device).type == "cpu":  # one mapping: no huge page half used
        caches = huge_page_empty((layers, 2, *shape), dtype)
        caches.zero_()  # every page resident now: the budget is held from the start, not won later
        return [(caches[layer, 0], caches[layer, 1]) for layer in range(layers)]
    return [
        (
            torch.zeros(shape, dtype=dtype, device=config.device),
            torch.zeros(shape, dtype=dtype, device=config.device),
        )
        for _ in range(layers)
    ]


@dataclass(frozen=True)
class ModelRunnerPlan:
    """The `RunnerPlan` of a real model: its KV dtype and block size, then the runner."""

    config: EngineConfig
    model_config: ModelConfig
    dtype: torch.dtype

    @property
    def kv_dtype(self) -> str:
        if self.config.kv_cache_dtype == "int8":
            return "int8"
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.model_config, self.config.block_size, self.dtype, self.config.kv_cache_dtype
        )

    def build(self, num_blocks: int, checkpoint: Checkpoint) -> ModelRunner:
        return ModelRunner(self.config, self.model_config, num_blocks, checkpoint)


def plan_model_runner(config: EngineConfig, model_config: ModelConfig) -> ModelRunnerPlan:
    """Set the device up (torch's threads, the CPU runtime; refuse CUDA that is not there)
    and plan a `ModelRunner` for it: the engine's default `PlanRunner`."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if config.device == "cpu":
        tune_cpu_runtime()
    elif not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} was asked for but CUDA is not available")
    return ModelRunnerPlan(config, model_config, engine_dtype(config, model_config))


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_token_indices: torch.Tensor  # [num_sampled]: each sampled request's last token


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        num_blocks: int,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = engine_dtype(config, model_config)
        self.block_size = config.block_size
        self.model = load_model(
            checkpoint or Checkpoint(config.model),
            model_config,
            dtype=str(self.dtype).removeprefix("torch."),
            device=config.device,
            show_progress=config.show_progress,
            # A GGUF file's blocks stay as stored on the CPU (the kernels that read them are
            # CPU kernels); --dequantize widens them, today's float path and the referee's.
            keep_gguf_blocks=self.device.type == "cpu" and not config.dequantize,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
            calibration=config.quantization_calibration,
        )
        if self.device.type == "cpu":
            prepare_for_cpu(self.model)
        self.kv_caches = allocate_kv_caches(config, model_config, num_blocks, self.dtype)
        if self.device.type == "cpu":
            # Decode steps in one native call (float32 caches only, for now: an int8 cache's
            # steps run layer by layer).
            self.model.bind_native_decoder(self.kv_caches)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def measure_draft_row_cost(self, num_drafts: int) -> DraftRowCost:
        """Speculative decoding's cost of a draft row here (:mod:`.draft_row_cost`); call it
        before any request (it writes scratch KV slots)."""
        num_blocks = int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0
        return measure_draft_row_cost(self, num_drafts, self.block_size, num_blocks)

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.temperature == 0.0:
            return None
        generator = self._generators.get(item.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[item.request_id] = generator
        return generator

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """The forward pass over every scheduled request, then sampling.

        A forward pass that raises is retried on halves of the batch until the failure is
        pinned on requests that fail alone; a sampling failure is pinned on its rows the
        same way, without running the model again.
        """
        self.copy_blocks(output.block_copies)
        scheduled = output.scheduled
        sampled: dict[str, SampledToken] = {}
        failed: dict[str, Exception] = {}
        # Filled by each attempt; a retry on a subset overwrites its items' entries.
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        forked: dict[str, SampledToken | Exception] = {}
        outcomes = isolate_failures(
            scheduled, lambda items: self._forward_and_sample(items, prompt_logprobs, forked)
        )
        for item, outcome in zip(scheduled, outcomes, strict=True):
            if isinstance(outcome, SampledToken):
                sampled[item.request_id] = outcome
            elif isinstance(outcome, Exception):
                failed[item.request_id] = outcome
        for request_id, fork_outcome in forked.items():
            if isinstance(fork_outcome, SampledToken):
                sampled[request_id] = fork_outcome
            else:
                failed[request_id] = fork_outcome
        for request_id in failed:
            prompt_logprobs.pop(request_id, None)
        return RunnerOutput(sampled, failed, prompt_logprobs)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy whole KV blocks, every layer's K and V (forked choices' partial blocks).
        Every source is read before any destination is written; no two copies share a
        destination (the scheduler allocates each one fresh)."""
        if not copies:
            return
        src = torch.tensor([c.src_block_id for c in copies], device=self.device)
        dst = torch.tensor([c.dst_block_id for c in copies], device=self.device)
        # [num_blocks, block_size (+ 1 if int8), kv_heads, head_dim]: an int8 block's scale
        # row travels with it
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _forward_and_sample(
        self,
        scheduled: Sequence[ScheduledRequest],
        prompt_logprobs: dict[str, list[TokenLogprob | None]],
        forked: dict[str, SampledToken | Exception] | None = None,
    ) -> list[SampledToken | Exception | None]:
        """One outcome per scheduled request: its token, its sampling failure, or None (a
        prefill chunk that samples nothing). The prompt logprobs a chunk owes go into
        ``prompt_logprobs`` (by request id), and its forks' tokens or sampling failures into
        ``forked`` (by the fork's request id; a fork is not sampled when its leader's
        forward pass fails)."""
        outcomes: list[SampledToken | Exception | None] = [None] * len(scheduled)
        if not scheduled:
            return outcomes
        if scheduled[0].num_steps > 1:  # a decode run: the scheduler made the whole step one
            return list(self._run_decodes(scheduled))
        # The flat batch: decodes (with their drafts) first, then prefill chunks.
        is_decode = [s.is_decode or bool(s.draft_token_ids) for s in scheduled]
        decode_rows = [i for i, decode in enumerate(is_decode) if decode]
        prefill_rows = [i for i, decode in enumerate(is_decode) if not decode]
        order = decode_rows + prefill_rows
        batch = self._prepare(
            [scheduled[i] for i in decode_rows], [scheduled[i] for i in prefill_rows]
        )
        if not prefill_rows and all(_samples_its_one_row(s) for s in scheduled):
            # a decode step: every row is sampled, its logits in one call (native on the CPU)
            rows = order
            logits = self.model.forward_logits(
                batch.input_ids, batch.positions, self.kv_caches, batch.metadata
            )
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
            # hidden: [num_tokens, hidden_size]
            self._compute_prompt_logprobs(hidden, [scheduled[i] for i in order], prompt_logprobs)
            sampled_rows = [i for i in order if scheduled[i].do_sample]  # sample_token_indices'
            rows = [i for i in sampled_rows if not scheduled[i].draft_token_ids]
            verified_rows = [i for i in sampled_rows if scheduled[i].draft_token_ids]
            if verified_rows:
                last_rows = dict(
                    zip(sampled_rows, batch.sample_token_indices.tolist(), strict=True)
                )
                verified = self._verify_drafts(
                    hidden, [(scheduled[i], last_rows[i]) for i in verified_rows]
                )
                for i, outcome in zip(verified_rows, verified, strict=True):
                    outcomes[i] = outcome
                if rows:
                    plain = torch.tensor([last_rows[i] for i in rows], device=hidden.device)
                    hidden = hidden.index_select(0, plain)
            elif rows and batch.sample_token_indices.shape[0] != hidden.shape[0]:
                # (as many sampled rows as tokens: every row, in order, as in a decode step)
                hidden = hidden[batch.sample_token_indices]
            if not rows:
                return outcomes
            logits = self.model.compute_logits(hidden)
        # logits: [num_sampled, vocab]
        to_sample, logits_rows = _sample_rows([scheduled[i] for i in rows])
        if len(to_sample) > len(rows):  # each fork's row: a copy of its leader's
            logits = logits.index_select(0, torch.tensor(logits_rows, device=logits.device))
            # logits: [num_sample_rows, vocab]
        sampled = self._sample(logits, to_sample)
        for logits_row, item, outcome in zip(logits_rows, to_sample, sampled, strict=True):
            if item.request_id == scheduled[rows[logits_row]].request_id:
                outcomes[rows[logits_row]] = outcome
            elif forked is not None:
                forked[item.request_id] = outcome
        return outcomes

    def _run_decodes(self, items: Sequence[ScheduledRequest]) -> list[SampledToken]:
        """A decode run's tokens (:mod:`.decode_run`), each item's last one carrying the run's
        earlier ones as kept drafts: the scheduler takes them back as it takes drafts."""
        runs = run_decodes(self.model, self.kv_caches, items, self.block_size, self.device)
        return [
            SampledToken(tokens[-1], None, tuple(SampledToken(t, None) for t in tokens[:-1]))
            for tokens in runs
        ]

    def _verify_drafts(
        self, hidden: torch.Tensor, items: Sequence[tuple[ScheduledRequest, int]]
    ) -> list[SampledToken | Exception]:
        """Verify each chunk's drafts (``items``: each with its last token's row in ``hidden``):
        its tokens (:mod:`.draft_verification`), or what its verification raised, pinned on it."""
        gather = [
            row for item, last in items for row in range(last - len(item.draft_token_ids), last + 1)
        ]
        logits = self.model.compute_logits(hidden[gather])  # [sum(k + 1), vocab]
        outcomes: list[SampledToken | Exception] = []
        offset = 0
        for item, _ in items:
            num_rows = len(item.draft_token_ids) + 1
            generator = self._generator(item) or self.default_generator
            try:
                outcomes.append(verify_drafts(logits[offset : offset + num_rows], item, generator))
            except Exception as exc:
                outcomes.append(exc)
            offset += num_rows
        return outcomes

    def _compute_prompt_logprobs(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        batch: Sequence[ScheduledRequest],  # in the batch's order
        prompt_logprobs: dict[str, list[TokenLogprob | None]],
    ) -> None:
        """The prompt logprobs each chunk owes, from its own rows of ``hidden`` (logits are
        computed only for the chunks of requests that ask)."""
        offset = 0
        for item in batch:
            if owes_prompt_logprobs(item):
                rows = hidden[offset : offset + item.num_tokens]
                entries = chunk_prompt_logprobs(self.model.compute_logits, rows, item)
                prompt_logprobs[item.request_id] = entries
            offset += item.num_tokens

    def _sample(
        self, logits: torch.Tensor, to_sample: list[ScheduledRequest]
    ) -> list[SampledToken | Exception]:
        """Tokens for the rows of ``logits`` (one per request in ``to_sample``), each row's
        failure pinned on it alone. Each row's logit bias and penalties apply first
        (:mod:`.logits_processing`), then a structured output's row is masked to what its
        grammar allows (so greedy, sampling and logprobs all see the processed row), and its
        matcher then accepts the token."""
        apply_logits_stage(logits, to_sample)
        params = [s.sampling_params for s in to_sample]
        num_rows = len(to_sample)
        matchers = {r: s.matcher for r, s in enumerate(to_sample) if s.matcher is not None}
        grammar_failures = mask_logits(logits, matchers)

        def choose(rows: Sequence[int]) -> list[int]:
            generators = [self._generator(to_sample[r]) for r in rows]
            row_logits = logits if len(rows) == num_rows else logits[list(rows)]
            return choose_tokens(
                row_logits, [params[r] for r in rows], generators, self.default_generator
            )

        token_ids = isolate_failures(range(num_rows), choose)
        chosen = {
            r: t
            for r, t in enumerate(token_ids)
            if isinstance(t, int) and r not in grammar_failures
        }
        accepting = {r: m for r, m in matchers.items() if r in chosen}
        grammar_failures |= accept_tokens(accepting, chosen)
        wanted = [r for r in chosen if params[r].logprobs is not None]
        logprobs: dict[int, TokenLogprob | Exception] = {}
        if wanted:

            def logprobs_of(rows: Sequence[int]) -> list[TokenLogprob]:
                return token_logprobs(
                    logits[list(rows)],
                    [chosen[r] for r in rows],
                    [params[r].logprobs or 0 for r in rows],
                )

            logprobs = dict(zip(wanted, isolate_failures(wanted, logprobs_of), strict=True))
        outcomes: list[SampledToken | Exception] = []
        for r, token_id in enumerate(token_ids):
            logprob = logprobs.get(r)
            failure = grammar_failures.get(r)
            if isinstance(token_id, Exception):
                outcomes.append(token_id)
            elif failure is not None:
                outcomes.append(failure)
            elif isinstance(logprob, Exception):
                outcomes.append(logprob)
            else:
                outcomes.append(SampledToken(token_id, logprob))
        return outcomes

    def _prepare(
        self, decodes: Sequence[ScheduledRequest], prefills: Sequence[ScheduledRequest]
    ) -> PreparedBatch:
        """The packed batch: the decodes' tokens, then the prefill chunks' tokens.

        A decode with drafts (speculative decoding) is several decode rows of one sequence,
        row j attending to the context up to its own token: every layer stores all rows' K and
        V before any row attends, so that is causal attention within the chunk, and the step
        stays a decode step (the native decoder's, on the CPU) rather than a prefill."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_token_indices: list[int] = []
        for item in (*decodes, *prefills):
            start = item.start_position
            table = item.block_table
            input_ids.extend(item.token_ids)
            span = range(start, start + item.num_tokens)
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            if item.do_sample:
                sample_token_indices.append(len(input_ids) - 1)

        device = self.device
        int32 = torch.int32
        decode_lens = [s.start_position + j + 1 for s in decodes for j in range(s.num_tokens)]
        decode_tables = [s.block_table for s in decodes for _ in range(s.num_tokens)]
        prefill_lens = [s.start_position + s.num_tokens for s in prefills]
        cu_q = [0]
        for s in prefills:
            cu_q.append(cu_q[-1] + s.num_tokens)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=_pad_tables(decode_tables, device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=int32, device=device),
            prefill_block_tables=_pad_tables([s.block_table for s in prefills], device),
            prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=int32, device=device),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=int32, device=device),
            max_decode_seq_len=max(decode_lens, default=0),
            max_prefill_seq_len=max(prefill_lens, default=0),
            max_prefill_query_len=max((s.num_tokens for s in prefills), default=0),
        )
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            metadata=metadata,
            sample_token_indices=torch.tensor(sample_token_indices, device=device),
        )


def _sample_rows(
    items: Sequence[ScheduledRequest],
) -> tuple[list[ScheduledRequest], list[int]]:
    """One sample row per sampled item and per fork of it, each as the item it is sampled
    as (a fork: its leader's item under its own id, settings and matcher; its penalties see
    the same tokens, the prompt), and the logits row each one reads."""
    to_sample: list[ScheduledRequest] = []
    logits_rows: list[int] = []
    for row, item in enumerate(items):
        to_sample.append(item)
        logits_rows.append(row)
        for fork in item.forks:
            as_fork = replace(
                item,
                request_id=fork.request_id,
                sampling_params=fork.sampling_params,
                matcher=fork.matcher,
                forks=(),
            )
            to_sample.append(as_fork)
            logits_rows.append(row)
    return to_sample, logits_rows


def _samples_its_one_row(item: ScheduledRequest) -> bool:
    """A one-token decode that samples its row and owes no prompt logprobs."""
    return (
        item.is_decode
        and item.do_sample
        and not item.draft_token_ids
        and not owes_prompt_logprobs(item)
    )


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    if not padded:
        return torch.zeros((0, 0), dtype=torch.int32, device=device)
    return torch.tensor(padded, dtype=torch.int32, device=device)
