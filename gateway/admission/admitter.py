"""Admission: whether one request may run, and what it holds if it does.

Two steps, the first refusal winning::

    PlanningStep   model access -> routing of aliases -> rollout version -> priority
                   -> prompt length -> output cap                (the policies; nothing counted)
    CountingStep   rate limits -> budget reservation             (one admission-store call)

The planning step decides from the key's cached quota; the counting step also checks that
the key's tenant did not change since the key was cached (`gateway.auth.key_cache`). If it
did, the key is read again and the request decided afresh; a refusal by the planning step
checks the epoch too, so a quota raised a moment ago is never refused on the old one.

The result is an `Admission` (forward it; settle or release its reservation exactly once, see
`gateway.accounting.settlement`) or a `Refusal` (`gateway.admission.outcomes`).
"""

from __future__ import annotations

from gateway.admission.counting_step import CountingStep
from gateway.admission.outcomes import Admission, Refusal
from gateway.admission.planning_step import PlanningStep
from gateway.auth.bearer_keys import auth_unavailable
from gateway.auth.key_cache import CachedKey, KeyCache
from gateway.completion_body import CompletionBody

_MAX_AUTH_RELOADS = 5  # a tenant changed this often during one request: answer 503


class Admitter:
    def __init__(self, planning: PlanningStep, counting: CountingStep, keys: KeyCache) -> None:
        self._planning = planning
        self._counting = counting
        self._keys = keys

    async def admit(
        self, key: CachedKey, body: CompletionBody, priority_header: str | None
    ) -> Admission | Refusal:
        """Raises a 401 `ApiError` if the key stopped working since it was cached."""
        for _ in range(_MAX_AUTH_RELOADS):
            plan = await self._planning.plan(key.caller, body, priority_header)
            if isinstance(plan, Refusal):
                epoch = await self._counting.current_epoch(key.caller.tenant_id)
                if epoch is None or epoch == key.epoch:  # None: Redis down, fail-open
                    return plan
            else:
                decision = await self._counting.count(key, plan)
                if isinstance(decision, Admission | Refusal):
                    return decision
                epoch = decision.epoch
            key = await self._keys.reload(key, epoch)
        raise auth_unavailable()
