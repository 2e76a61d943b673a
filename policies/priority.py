"""The scheduling class of a request: ``interactive`` or ``batch``.

The request's header value wins over the API key's default, which wins over the
tenant's ``priority``. The tenant's class is also a ceiling: a batch tenant runs
as batch whatever its keys or requests say, so it cannot jump the interactive
queue. A request may always ask for ``batch``. The result goes to the engine
scheduler with the tenant id.
"""

from __future__ import annotations

from policies.decision import Rejection
from policies.quota import PRIORITY_CLASSES, PriorityClass, TenantQuota


def resolve_priority(
    header_value: str | None, key_default: PriorityClass | None, quota: TenantQuota
) -> PriorityClass | Rejection:
    """The class to schedule with, or a 400 for a header value that names none."""
    requested: PriorityClass = quota.priority
    if key_default is not None:
        requested = key_default
    if header_value is not None:
        parsed = _parse(header_value)
        if parsed is None:
            return Rejection(
                status=400,
                code="invalid_value",
                type="invalid_request_error",
                message=(
                    f"Invalid priority {header_value!r}: use one of {', '.join(PRIORITY_CLASSES)}."
                ),
                param="priority",
            )
        requested = parsed
    if quota.priority == "batch":
        return "batch"
    return requested


def _parse(value: str) -> PriorityClass | None:
    normalized = value.strip().lower()
    for cls in PRIORITY_CLASSES:
        if normalized == cls:
            return cls
    return None
