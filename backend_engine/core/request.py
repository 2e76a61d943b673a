"""A request's life inside the engine: plain Python, no tensors."""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from backend_engine.outputs import FinishReason, TokenLogprob
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams


class OutputMatcher(Protocol):
    """A request's structured-output state (``backend_engine.structured_output.matcher``):
    the core carries it from the engine to the runner and asks only whether it is finished."""

    mask_bytes: int

    def fill_mask(self, address: int) -> None: ...

    def accept(self, token_id: int) -> None: ...

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar would accept in turn (state unchanged)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts (drafts scored, then dropped)."""
        ...

    @property
    def is_finished(self) -> bool: ...


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # A choice of an ``n`` > 1 request held by its leader until the leader's prefill ends:
    # it is then forked off the leader's KV blocks (see ``Scheduler``), never prefilled.
    AWAITING_FORK = "awaiting_fork"
    FINISHED = "finished"


class Request:
    """Token ids and progress of one request.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache. The
    tokens still to compute are ``all_token_ids[num_computed_tokens:]``: the
    rest of the prompt while prefilling, the last sampled token while decoding,
    or everything after a preemption (recompute).

    A request with ``n`` > 1 is a group of choices: the leader (choice 0, the caller's id)
    holds the others in ``pending_forks`` until its prefill ends; each of them has its own
    ``request_id`` and ``choice_index`` and the leader's id as ``group_id``, and points back
    at the leader (``fork_parent``) while it waits to be forked.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_seq",
        "arrival_time",
        "block_hashes",
        "choice_index",
        "draft_token_ids",
        "finish_reason",
        "fork_parent",
        "group_id",
        "matcher",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "pending_forks",
        "priority",
        "prompt_logprobs",
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
        *,
        group_id: str | None = None,
        choice_index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """``arrival_time``: when it was accepted (``time.monotonic()``), for its queue time;
        None: not measured."""
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.group_id = group_id if group_id is not None else request_id  # the caller's id
        self.choice_index = choice_index
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
        # With ``prompt_logprobs``: one entry per prompt token (the first None), filled in as
        # its prefill chunks are computed.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [] if sampling_params.prompt_logprobs is not None else None
        )
        # The leader's other choices, until its prefill ends (see the class docstring).
        self.pending_forks: list[Request] = []
        self.fork_parent: Request | None = None  # the leader, while AWAITING_FORK
        # Speculative decoding: tokens proposed to follow its last one, set by the engine before
        # a step (``backend_engine.speculative``). The scheduler may schedule them with the last
        # token, to be verified; they never join ``all_token_ids`` unless the target keeps them.
        self.draft_token_ids: tuple[int, ...] = ()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether some of its prompt logprobs are still to compute: they need the prompt's
        logits, so the prefix cache cannot stand in for its prefill."""
        prompt_logprobs = self.prompt_logprobs
        return prompt_logprobs is not None and len(prompt_logprobs) < self.num_prompt_tokens

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
