"""A request's life inside the engine: plain Python, no tensors."""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from backend_engine.outputs import FinishReason
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams


class OutputMatcher(Protocol):
    """A request's structured-output state (``backend_engine.structured_output.matcher``):
    the core carries it from the engine to the runner and asks only whether it is finished."""

    mask_bytes: int

    def fill_mask(self, address: int) -> None: ...

    def accept(self, token_id: int) -> None: ...

    @property
    def is_finished(self) -> bool: ...


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Token ids and progress of one request.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache. The
    tokens still to compute are ``all_token_ids[num_computed_tokens:]``: the
    rest of the prompt while prefilling, the last sampled token while decoding,
    or everything after a preemption (recompute).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_seq",
        "block_hashes",
        "finish_reason",
        "matcher",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "sampling_params",
        "status",
        "stop_token_id",
        "tenant_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_seq: int,
        tenant_id: str = "default",
        priority: Priority = Priority.INTERACTIVE,
        matcher: OutputMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_seq = arrival_seq
        self.tenant_id = tenant_id
        self.priority = priority
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first admitted; None until then.
        self.num_cached_tokens: int | None = None
        self.block_hashes: list[bytes] = []  # hash chain of this request's full blocks
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # The eos or stop token the scheduler finished it on (see stop_rules); never shown as text.
        self.stop_token_id: int | None = None
        # Where its output is in its grammar, for a structured output; kept across preemption
        # (a recompute brings back the same tokens the matcher has already accepted).
        self.matcher = matcher

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
