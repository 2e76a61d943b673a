"""What the engine loop needs from whatever computes its tokens, with no torch in sight.

`LLMEngine` asks a `RunnerPlan` how large one KV block is (to size the cache from its memory
budget) and then has the plan build the `StepRunner` that runs every scheduled step. The
real one is `backend_engine.worker.model_runner.plan_model_runner` (torch: the model, its KV
tensors, sampling), imported only when an engine is built without another plan. So the
scheduler, the output processor, `AsyncEngine` and the HTTP server import without torch, and
a test can run them all behind a stand-in runner (`tests/support/stand_in_runner.py`) in an
environment that has no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from backend_engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from backend_engine.config import EngineConfig
    from backend_engine.core.scheduler import SchedulerOutput
    from model_files.checkpoint import Checkpoint
    from model_files.model_config import ModelConfig


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None
    # Speculative decoding: the drafts the target kept, each with its logprob, which come
    # before ``token_id`` (the target's own token after them).
    accepted_drafts: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, SampledToken]  # request id (a fork's too) -> its token this step
    failed: dict[str, Exception]  # requests whose work raised even alone: only they fail
    # request id -> the prompt logprobs its chunk computed this step, continuing those already
    # reported (`ScheduledRequest.num_reported_prompt_logprobs`); the first prompt token's is None
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)


class StepRunner(Protocol):
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Copy the KV blocks ``output.block_copies`` names, then compute every scheduled
        item; a token for each item with ``do_sample`` and for each of its ``forks`` (from
        the item's logits, under the fork's id and settings), and the prompt logprobs each
        chunk of a request with ``prompt_logprobs`` owes. An item with ``draft_token_ids``
        has them verified: its token carries the drafts kept before it."""
        ...

    def release(self, request_id: str) -> None:
        """Forget what the runner holds for a request that has ended (its generator)."""
        ...


@dataclass(frozen=True)
class DraftRowCost:
    """What scoring drafts costs a runner: ``row_cost``, a step of one token and some drafts
    against a step of one token, less one, per draft (0: free); ``step_seconds``, the step of
    one token (a draft model's own time per draft is weighed against it)."""

    row_cost: float
    step_seconds: float


@runtime_checkable
class DraftRowCostProbe(Protocol):
    """A runner that can say what scoring drafts costs it (speculative decoding's adaptive k
    weighs a draft's cost against its chance of being kept)."""

    def measure_draft_row_cost(self, num_drafts: int) -> DraftRowCost: ...


class RunnerPlan(Protocol):
    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype ("float32", ...): part of the prefix-cache key, so blocks
        computed in another dtype never match."""
        ...

    @property
    def kv_bytes_per_block(self) -> int: ...

    def build(self, num_blocks: int, checkpoint: Checkpoint) -> StepRunner: ...


# Called once per engine, after the checkpoint is checked and before the KV cache is sized.
PlanRunner = Callable[["EngineConfig", "ModelConfig"], RunnerPlan]
