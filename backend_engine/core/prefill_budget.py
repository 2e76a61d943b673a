"""How one step's prefill tokens are shared among tenants.

Decodes go first (one token each); what is left of the step's token budget is prefill
budget. Every tenant with prefill work this step (the next chunks of its prompts in
progress, and its waiting requests that could be admitted) contends for it, in the
waiting queue's turn order (interactive first, then the tenant with the fewest running
requests, then the oldest work), and gets a max-min fair share (water-filling):

    budget 2,000; A wants 1,900 (a 2,000-token prompt in progress), B wants 30 (a new
    request), C wants 600: B gets 30 and C 600 (each less than an equal third), and A
    the 1,370 left

Prefill tokens are divisible (a prompt is prefilled in chunks of any size), so the fluid
fair share can be given exactly each step: deficit round-robin's carried deficit, which
exists because a packet cannot be split, is never needed. A tenant with one short request
therefore has it prefilled in the next step however long the other tenants' prompts are,
and the split is work-conserving: what a tenant cannot use goes to the others.

Except in a *first-token step*: when a tenant with no prompt in progress has a request to
admit while another tenant has prompts in progress, the step carries the newcomer's own
share and the running decodes only (:func:`first_token_tenants`). The step is then as short
as the newcomer's chunk, and its first token waits for the rest of the step in flight plus
that short step, not for a full step of the other tenant's chunks as well. The others' chunks
are only shifted by one short step, and two first-token steps never follow each other, so a
stream of newcomers cannot starve the prompts in progress (they get at least every other
step, whole).

Pure decisions over requests and counts; the scheduler spends the shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from backend_engine.core.request import Request
from backend_engine.core.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class PrefillContender:
    """A tenant with prefill work this step: tokens it could use, and its place in turn."""

    tenant_id: str
    num_tokens: int
    turn_key: tuple[int, int, int]  # (best priority, running requests, oldest arrival)


def share_prefill_budget(budget: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Max-min fair shares of ``budget`` (water-filling): each tenant gets what it asks
    for or an equal part of what is left, whichever is smaller, repeated until the budget
    or the demand runs out. An uneven split's remainder goes to the tenants first in
    ``demands``' order, one token each."""
    shares = dict.fromkeys(demands, 0)
    hungry = [tenant for tenant, demand in demands.items() if demand > 0]
    left = budget
    while left > 0 and hungry:
        quantum, num_extra = divmod(left, len(hungry))
        still_hungry = []
        for index, tenant in enumerate(hungry):
            offer = quantum + (index < num_extra)
            wanted = demands[tenant] - shares[tenant]
            given = min(wanted, offer)
            shares[tenant] += given
            left -= given
            if wanted > offer:
                still_hungry.append(tenant)
        hungry = still_hungry
    return shares


def prefill_contenders(
    running_prefills: Iterable[Request],
    waiting: WaitingQueue,
    num_running_by_tenant: Mapping[str, int],
    budget: int,
    num_free_seqs: int,
    max_running: int | None,
    num_uncached_tokens: Callable[[Request], int],
) -> list[PrefillContender]:
    """The tenants that want prefill tokens this step, in turn order.

    A tenant wants the rest of each prompt it has in progress, plus the uncached prompt
    tokens of the waiting requests it could have admitted (as many as free sequences and
    its running-share cap allow, in its queue order), at most ``budget`` in all. A guess
    for waiting requests (blocks may still refuse one): whatever a tenant cannot spend, the
    scheduler hands on.
    """
    demand: dict[str, int] = {}
    keys: dict[str, tuple[int, int]] = {}  # (best priority, oldest arrival)

    def note(request: Request, num_tokens: int) -> None:
        tenant = request.tenant_id
        demand[tenant] = min(demand.get(tenant, 0) + num_tokens, budget)
        key = (int(request.priority), request.arrival_seq)
        keys[tenant] = min(keys.get(tenant, key), key)

    for request in running_prefills:
        note(request, request.num_tokens - request.num_computed_tokens)
    for tenant in waiting.tenants:
        if waiting.is_capped(tenant, num_running_by_tenant, max_running):
            continue
        num_seqs = num_free_seqs
        if max_running is not None and len(waiting.tenants) > 1:
            num_seqs = min(num_seqs, max_running - num_running_by_tenant.get(tenant, 0))
        for request in waiting.of_tenant(tenant):
            if num_seqs <= 0 or demand.get(tenant, 0) >= budget:
                break
            note(request, num_uncached_tokens(request))
            num_seqs -= 1
    contenders = [
        PrefillContender(
            tenant,
            num_tokens,
            (keys[tenant][0], num_running_by_tenant.get(tenant, 0), keys[tenant][1]),
        )
        for tenant, num_tokens in demand.items()
    ]
    return sorted(contenders, key=lambda c: c.turn_key)


def first_token_tenants(
    contenders: Iterable[PrefillContender], running_prefills: Iterable[Request]
) -> frozenset[str]:
    """The tenants whose first chunk makes this step a first-token step: those contending
    with no prompt in progress (their demand is only waiting requests), when some other
    tenant has a prompt in progress. Empty when nobody is left waiting for a step's worth of
    another tenant's chunks (one tenant, or nobody with a prompt in progress)."""
    in_progress = {request.tenant_id for request in running_prefills}
    newcomers = frozenset(c.tenant_id for c in contenders if c.tenant_id not in in_progress)
    return newcomers if in_progress and newcomers else frozenset()


def running_cap(max_num_seqs: int, max_running_share: float) -> int:
    """The most requests one tenant may run while another waits: its share of
    ``max_num_seqs``, rounded down, and at least one."""
    if not 0.0 < max_running_share <= 1.0:
        raise ValueError(f"max_running_share must be in (0, 1], got {max_running_share}")
    return max(1, int(max_running_share * max_num_seqs + 1e-9))
