"""The draft-model proposer: a small model that shares the target's vocabulary proposes its
greedy tokens (issue #29).

Greedy, because the drafts are then a deterministic function of the sequence, so the runner's
verification with a one-hot draft distribution (``draft_probs=None``) is exact rejection
sampling: a draft x is kept with probability p(x), otherwise the token is drawn from p without
x, which together is p. The target's output is what it would be without speculation, greedy
or sampled, whatever the drafter says; a better drafter only gets more of its drafts kept.

The drafter runs on the engine's own model code (`backend_engine.models.load_model`) on the
engine's device and dtype setting, unquantized; a GGUF drafter keeps its blocks as stored on
the CPU (SmolLM2's Q4_1 file drafts cheaply for a float32 target).

Its KV cache is paged like the target's, in as many blocks of its own (so it holds as many
tokens), without prefix caching. Per sequence it remembers how many of the sequence's final
tokens its cache holds, and the drafts whose KV it wrote after them::

    positions:  0 ........ L-1 | L   L+1 ... L+k-2
    KV holds:   final tokens   | d1  d2  ... d(k-1)     (dk is chosen, never written)

A proposal, for one sequence or a batch of them packed into each forward pass:

1. Catch up on the sequence's final tokens past its cache: those the target kept that equal
   the written drafts need nothing, the rest go in chunks of at most the step's token budget
   (the whole prompt at the first call). A chunk of at most k + 1 tokens, what one
   verification adds, goes as decode rows, row j attending up to its own token (every layer
   stores all rows' K and V before any row attends), so on the CPU the native decoder runs
   it; a longer one as a prefill chunk. The last token's row gives d1.
2. k - 1 single-token greedy decode steps give d2 ... dk.

A sequence whose blocks run out proposes nothing, and keeps what its cache holds.

Each draft costs the drafter a pass, so the adaptive k weighs it
(:func:`.speculator.make_speculator`): ``measure_draft_seconds`` times one at start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backend_engine.config import EngineConfig
from backend_engine.core.request import Request
from backend_engine.models import load_model
from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.worker.model_runner import allocate_kv_caches, engine_dtype, prepare_for_cpu
from backend_engine.worker.sampler import argmax_rows
from model_files.checkpoint import Checkpoint

_SCRATCH_CONTEXT = 64  # tokens before the timed draft's (a short conversation's worth)
_NUM_TIMED = 7


@dataclass
class _DraftSequence:
    """What the drafter's cache holds for one sequence."""

    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading final tokens whose KV is in the blocks
    written_drafts: tuple[int, ...] = ()  # the drafts whose KV follows them


@dataclass
class _Proposal:
    """One sequence's proposal in progress: its final tokens, its cache's progress through
    them, its k and the drafts chosen so far."""

    index: int  # in the batch asked for
    sequence: _DraftSequence
    token_ids: Sequence[int]
    num_reused: int  # held by the cache when it began
    num_done: int
    k: int
    drafts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Chunk:
    """Tokens of one proposal at ``start`` on, in one forward pass."""

    proposal: _Proposal
    token_ids: Sequence[int]
    start: int
    as_decode_rows: bool


class DraftModelProposer:
    """The ``draft`` proposer: a drafter's greedy tokens (see the module docstring)."""

    name = "draft"

    def __init__(self, config: EngineConfig, target_vocab_size: int, num_blocks: int) -> None:
        """Load the drafter named by ``config.speculative_draft_model`` and give it a cache of
        ``num_blocks`` blocks; refuse one whose vocabulary is not the target's
        (``target_vocab_size`` tokens)."""
        path = config.speculative_draft_model
        if path is None:
            raise ValueError("speculative_proposer='draft' needs speculative_draft_model")
        checkpoint = Checkpoint(path)
        model_config = checkpoint.check()
        if model_config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model {path} has a vocabulary of {model_config.vocab_size} tokens "
                f"and the target one of {target_vocab_size}: a draft model must share the "
                "target's tokenizer"
            )
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_model_len = model_config.max_model_len
        self.max_chunk_tokens = config.step_token_budget
        self.max_decode_rows = config.num_speculative_tokens + 1
        self.num_blocks = num_blocks
        dtype = engine_dtype(config, model_config)
        on_cpu = self.device.type == "cpu"
        self.model = load_model(
            checkpoint,
            model_config,
            dtype=str(dtype).removeprefix("torch."),
            device=config.device,
            show_progress=config.show_progress,
            keep_gguf_blocks=on_cpu,
        )
        if on_cpu:
            prepare_for_cpu(self.model)
        self.kv_caches = allocate_kv_caches(config, model_config, num_blocks, dtype)
        if on_cpu:
            self.model.bind_native_decoder(self.kv_caches)
        self._free_block_ids = list(range(num_blocks - 1, -1, -1))  # taken from the end
        self._sequences: dict[str, _DraftSequence] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        return self.propose_batch([(request, k)])[0]

    @torch.inference_mode()
    def propose_batch(self, wanted: Sequence[tuple[Request, int]]) -> list[tuple[int, ...]]:
        """Each request's drafts (up to its k; none where there is no room), all sequences
        packed into one forward pass per catch-up chunk and per draft position."""
        proposals: list[_Proposal] = []
        for index, (request, k) in enumerate(wanted):
            token_ids = request.all_token_ids
            # Drafts past max_tokens - 1 cannot be kept; positions past the drafter's length
            # cannot be computed.
            k = min(
                k,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - len(token_ids) + 1,
            )
            if k < 1:
                continue
            sequence = self._sequences.setdefault(request.request_id, _DraftSequence())
            if not self._reserve(sequence, len(token_ids) + k - 1):
                continue
            num_reused = _num_reusable(sequence, token_ids)
            proposals.append(_Proposal(index, sequence, token_ids, num_reused, num_reused, k))
        try:
            self._catch_up(proposals)
            for position in range(1, max((p.k for p in proposals), default=1)):
                self._greedy(
                    [
                        _Chunk(p, p.drafts[-1:], len(p.token_ids) + position - 1, True)
                        for p in proposals
                        if p.k > position
                    ]
                )
        except BaseException:
            # What a pass wrote from each catch-up's start on is unknown: trust none of it.
            for proposal in proposals:
                sequence = proposal.sequence
                sequence.num_computed = min(sequence.num_computed, proposal.num_reused)
                sequence.written_drafts = ()
            raise
        drafts: list[tuple[int, ...]] = [()] * len(wanted)
        for proposal in proposals:
            sequence = proposal.sequence
            sequence.num_computed = len(proposal.token_ids)
            sequence.written_drafts = tuple(proposal.drafts[:-1])
            drafts[proposal.index] = tuple(proposal.drafts)
        return drafts

    @torch.inference_mode()
    def measure_draft_seconds(self) -> float:
        """Seconds one draft takes: a one-token greedy pass for one sequence (its row, the
        output projection and the argmax), on scratch blocks at a short context; the fastest
        of a few after a warm-up (other work on a shared machine only ever adds time). 0 where
        the cache has no room. Call it before any request."""
        scratch = _DraftSequence()
        context = min(_SCRATCH_CONTEXT, self.max_model_len - 1)
        if context < 1 or not self._reserve(scratch, context + 1):
            return 0.0
        proposal = _Proposal(0, scratch, [0] * (context + 1), context, context, 1)
        chunk = _Chunk(proposal, [0], context, True)
        times = []
        try:
            for attempt in range(_NUM_TIMED + 2):
                proposal.drafts.clear()
                start = time.perf_counter()
                self._greedy([chunk])
                if attempt >= 2:
                    times.append(time.perf_counter() - start)
        finally:
            self._free_block_ids.extend(reversed(scratch.block_ids))
        return min(times)

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self._free_block_ids.extend(reversed(sequence.block_ids))

    def _reserve(self, sequence: _DraftSequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions, or False (and nothing taken) if too few are free."""
        num_needed = -(-num_tokens // self.block_size) - len(sequence.block_ids)
        if num_needed > len(self._free_block_ids):
            return False
        for _ in range(num_needed):
            sequence.block_ids.append(self._free_block_ids.pop())
        return True

    def _catch_up(self, proposals: Sequence[_Proposal]) -> None:
        """Compute each proposal's final tokens past its cache, a chunk per pass, and choose
        its first draft from its last token's row."""
        while True:
            chunks = []
            for p in proposals:
                num_left = len(p.token_ids) - p.num_done
                if num_left == 0:
                    continue
                as_decode_rows = num_left <= self.max_decode_rows
                num_tokens = num_left if as_decode_rows else min(num_left, self.max_chunk_tokens)
                chunk_ids = p.token_ids[p.num_done : p.num_done + num_tokens]
                chunks.append(_Chunk(p, chunk_ids, p.num_done, as_decode_rows))
                p.num_done += num_tokens
            if not chunks:
                return
            self._greedy(chunks)

    def _greedy(self, chunks: Sequence[_Chunk]) -> None:
        """One forward pass over ``chunks``; each chunk that ends its proposal's tokens so far
        (final tokens and drafts) appends the drafter's greedy choice after it."""
        decodes = [c for c in chunks if c.as_decode_rows]
        prefills = [c for c in chunks if not c.as_decode_rows]
        input_ids, positions, metadata = self._pack(decodes, prefills)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        # hidden: [num_tokens, hidden_size]
        last_rows: list[int] = []
        choosing: list[_Proposal] = []
        row = 0
        for chunk in (*decodes, *prefills):
            row += len(chunk.token_ids)
            proposal = chunk.proposal
            if chunk.start + len(chunk.token_ids) == len(proposal.token_ids) + len(proposal.drafts):
                last_rows.append(row - 1)
                choosing.append(proposal)
        if not choosing:
            return
        rows = torch.tensor(last_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_chosen, vocab]
        for proposal, token_id in zip(choosing, argmax_rows(logits).tolist(), strict=True):
            proposal.drafts.append(int(token_id))

    def _pack(
        self, decodes: Sequence[_Chunk], prefills: Sequence[_Chunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The packed batch, as the model runner packs a step: decode rows (one per token of a
        chunk sent as decode rows), then prefill chunks."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in (*decodes, *prefills):
            table = chunk.proposal.sequence.block_ids
            span = range(chunk.start, chunk.start + len(chunk.token_ids))
            input_ids.extend(chunk.token_ids)
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        decode_lens = [c.start + j + 1 for c in decodes for j in range(len(c.token_ids))]
        decode_tables = [c.proposal.sequence.block_ids for c in decodes for _ in c.token_ids]
        prefill_lens = [c.start + len(c.token_ids) for c in prefills]
        cu_q = [0]
        for c in prefills:
            cu_q.append(cu_q[-1] + len(c.token_ids))
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=_pad_tables(decode_tables, device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            prefill_block_tables=_pad_tables(
                [c.proposal.sequence.block_ids for c in prefills], device
            ),
            prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
            max_decode_seq_len=max(decode_lens, default=0),
            max_prefill_seq_len=max(prefill_lens, default=0),
            max_prefill_query_len=max((len(c.token_ids) for c in prefills), default=0),
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            metadata,
        )


def _num_reusable(sequence: _DraftSequence, token_ids: Sequence[int]) -> int:
    """How many leading final tokens the sequence's cache holds: those computed, then the
    written drafts the target kept; never the last token, whose row gives the first draft."""
    num_done = sequence.num_computed
    for draft in sequence.written_drafts:
        if num_done >= len(token_ids) or token_ids[num_done] != draft:
            break
        num_done += 1
    return min(num_done, len(token_ids) - 1)


def _pad_tables(tables: Sequence[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one [num_rows, max_blocks] int32 tensor, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    if not padded:
        return torch.zeros((0, 0), dtype=torch.int32, device=device)
    return torch.tensor(padded, dtype=torch.int32, device=device)
