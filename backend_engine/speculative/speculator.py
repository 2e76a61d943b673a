"""Speculative decoding in the engine's loop: each step's drafts, and what their verification
taught.

Before a step is planned, every running sequence that is decoding (one token left to compute)
gets a k from its adaptive policy (:mod:`.adaptive_k`, given how many sequences run) and, if
k > 0, up to k drafts from the proposer, set on the request (``Request.draft_token_ids``). The
scheduler schedules them after the sequence's last token where the step has room, the runner
verifies them, and the scheduler keeps what the target accepted. After the step, each
sequence that decoded records how many of its scheduled drafts were kept, which moves its k,
and the proposer's counters grow (the engine's ``/metrics``).

A proposer that raises for a sequence fails that sequence alone (``propose`` returns the
failures for the engine to finish), the way the runner pins a failure on its request.

Proposers:

- ``ngram`` (prompt lookup, :class:`NgramProposer`): each sequence's :class:`.NgramIndex` is
  fed its final tokens as they come (drafts never), and rebuilt only if the sequence lost
  tokens.
- ``draft`` (a small model's greedy tokens, :mod:`.draft_model`, torch, imported only when
  chosen): a :class:`BatchProposer`, so all the step's speculating sequences draft together;
  if that raises, they draft one by one, and the failure is pinned on its own request.

Plain Python: no tensors, so it runs beside the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from backend_engine.config import EngineConfig
from backend_engine.core.request import Request
from backend_engine.core.scheduler_output import ScheduledRequest
from backend_engine.core.step_runner import DraftRowCost
from backend_engine.outputs import SpeculativeCounts
from backend_engine.speculative.adaptive_k import (
    AdaptiveKSettings,
    AdaptiveKState,
    choose_k,
    initial_state,
    record_step,
)
from backend_engine.speculative.ngram_proposer import NgramIndex


class Proposer(Protocol):
    name: str

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to follow the request's last one (fewer, or none, if unsure)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that has ended."""
        ...


@runtime_checkable
class BatchProposer(Proposer, Protocol):
    """A proposer that drafts for several sequences at once, cheaper than one by one (a draft
    model: one forward pass per draft position for all of them)."""

    def propose_batch(self, wanted: Sequence[tuple[Request, int]]) -> list[tuple[int, ...]]:
        """Each ``(request, k)``'s drafts, in order, as ``propose`` would give them."""
        ...


class NgramProposer:
    """Prompt lookup over each sequence's own prompt and output."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        token_ids = request.all_token_ids
        index = self._indexes.get(request.request_id)
        if index is None or index.num_tokens > len(token_ids):
            index = NgramIndex(self.min_n, self.max_n)
            self._indexes[request.request_id] = index
        index.extend(token_ids[index.num_tokens :])
        return index.propose(k)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


class Speculator:
    """Drafts for each step and the per-sequence adaptive k, over one proposer."""

    def __init__(self, proposer: Proposer, settings: AdaptiveKSettings) -> None:
        self.proposer = proposer
        self.settings = settings
        self.counts = SpeculativeCounts()
        self._states: dict[str, AdaptiveKState] = {}

    def propose(self, running: Sequence[Request]) -> dict[str, Exception]:
        """Set this step's drafts on the decoding sequences of ``running``; returns the
        requests whose proposer raised (they get no drafts; the caller fails them)."""
        failures: dict[str, Exception] = {}
        batch_size = len(running)
        wanted: list[tuple[Request, int]] = []
        for request in running:
            request.draft_token_ids = ()
            if not is_drafting(request):
                continue
            state = self._states.get(request.request_id)
            if state is None:
                state = self._states[request.request_id] = initial_state(self.settings)
            k = choose_k(self.settings, state, batch_size)
            if k > 0:
                wanted.append((request, k))
        proposer = self.proposer
        if isinstance(proposer, BatchProposer) and len(wanted) > 1:
            try:
                proposed = proposer.propose_batch(wanted)
            except Exception:
                pass  # one by one below, so that a failure is pinned on its own request
            else:
                for (request, k), drafts in zip(wanted, proposed, strict=True):
                    request.draft_token_ids = tuple(drafts)[:k]
                return failures
        for request, k in wanted:
            try:
                request.draft_token_ids = tuple(proposer.propose(request, k))[:k]
            except Exception as exc:
                failures[request.request_id] = exc
        return failures

    def record(
        self, scheduled: Iterable[ScheduledRequest], num_accepted: Mapping[str, int]
    ) -> None:
        """After a step: each decoding sequence's drafts scored and kept (``num_accepted``, by
        request id, for those that got tokens) move its k and the counts."""
        counts = self.counts
        num_chunks, num_drafts, num_kept = 0, 0, 0
        for item in scheduled:
            state = self._states.get(item.request_id)
            if state is None or not (item.is_decode or item.draft_token_ids):
                continue
            if item.request_id not in num_accepted:
                continue  # it failed this step: nothing was verified
            proposed = len(item.draft_token_ids)
            kept = num_accepted[item.request_id]
            self._states[item.request_id] = record_step(self.settings, state, proposed, kept)
            if proposed:
                num_chunks += 1
                num_drafts += proposed
                num_kept += kept
        if num_chunks:
            self.counts = SpeculativeCounts(
                counts.num_verified_chunks + num_chunks,
                counts.num_draft_tokens + num_drafts,
                counts.num_accepted_tokens + num_kept,
            )

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.proposer.forget(request_id)


def is_drafting(request: Request) -> bool:
    """Whether a request may have drafts this step: it decodes (one token left to compute, one
    it sampled: a prompt whose last chunk is one token is still a prefill, whose step samples
    its pending choices' first tokens too)."""
    return (
        request.num_tokens - request.num_computed_tokens == 1
        and request.num_output_tokens > 0
        and not request.pending_forks
    )


@runtime_checkable
class DraftTimeProbe(Protocol):
    """A proposer whose drafts cost time of their own (a draft model's passes, one per draft
    position): it can measure one, before any request."""

    def measure_draft_seconds(self) -> float:
        """Seconds to propose one draft for one sequence (the fastest of a few tries)."""
        ...


def make_speculator(
    config: EngineConfig,
    target_vocab_size: int,
    num_kv_blocks: int,
    target_cost: DraftRowCost | None = None,
) -> Speculator | None:
    """The engine's speculator as configured; None when speculative decoding is off.

    ``target_vocab_size``: the target model's, which a draft model must share;
    ``num_kv_blocks``: the target's KV blocks, as many as a draft model's cache gets;
    ``target_cost``: what scoring a draft costs the target, measured by its runner (None: not
    measured, so free). A draft's cost (``AdaptiveKSettings.draft_cost``) is
    ``config.speculative_draft_cost`` if set, else that row cost plus, for a proposer with
    passes of its own (a draft model), its time per draft over the target's one-token step."""
    if config.speculative_proposer is None:
        return None
    proposer = _make_proposer(config, target_vocab_size, num_kv_blocks)
    draft_cost = config.speculative_draft_cost
    if draft_cost is None:
        draft_cost = target_cost.row_cost if target_cost is not None else 0.0
        if (
            isinstance(proposer, DraftTimeProbe)
            and target_cost is not None
            and target_cost.step_seconds > 0.0
        ):
            draft_cost += proposer.measure_draft_seconds() / target_cost.step_seconds
    settings = AdaptiveKSettings(
        max_k=config.num_speculative_tokens,
        crossover_batch_size=config.speculative_crossover_batch_size,
        draft_cost=draft_cost,
    )
    return Speculator(proposer, settings)


def _make_proposer(config: EngineConfig, target_vocab_size: int, num_kv_blocks: int) -> Proposer:
    proposer: Proposer
    if config.speculative_proposer == "draft":
        # Imported here: the draft model brings torch, which the engine's loop never imports.
        from backend_engine.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, target_vocab_size, num_kv_blocks)
    else:
        proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    return proposer
