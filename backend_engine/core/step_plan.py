"""The scheduler's step while it is planned: what is left of the token budget, what is
scheduled so far and who was preempted or admitted. Plain bookkeeping over requests; the
scheduler alone decides."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.core.request import Request


@dataclass
class StepPlan:
    """The step being planned. ``unscheduled``: running requests not yet scheduled (the
    preemption victims); ``is_admission_closed``: an admission was refused for blocks."""

    budget: int
    unscheduled: list[Request]
    scheduled: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    is_admission_closed: bool = False

    def num_left(self, request: Request) -> int:
        """Tokens of a running request still to compute after what this step has for it."""
        return request.num_tokens - request.num_computed_tokens - self.scheduled.get(request, 0)

    def add(self, request: Request, num_new: int) -> None:
        self.scheduled[request] = self.scheduled.get(request, 0) + num_new
        self.budget -= num_new


def is_prefill(request: Request) -> bool:
    """Whether a running request has more than one token to compute (else it decodes)."""
    return request.num_tokens - request.num_computed_tokens > 1
