"""Whether each engine replica may take a request: its active check, and passive ejection.

Two signals, kept apart:

- **ready** comes from the active checks (``GET /ready``, see `gateway.upstream.health_checks`):
  a replica whose last check failed is skipped until one passes.
- **ejected** comes from the requests themselves: ``failures_to_eject`` consecutive failures
  (a connection error, a 5xx before the first token) eject the replica for a backoff. The
  backoff doubles with each ejection up to ``backoff_max_s``; one success resets it all.

::

    ok ─fail─► 1 ─fail─► ... ─fail─► K: ejected for backoff_s
                                      │ the backoff runs out: on probation
                                      ├─ fail: ejected again for 2x (up to backoff_max_s)
                                      └─ success: ok, the backoff back to backoff_s

`ReplicaHealth` is plain state over a clock passed in; the pool records outcomes and asks
`is_available`. When no replica of a model is available the pool tries them all anyway:
a try that may work beats a certain 503.
"""

from __future__ import annotations

from gateway.replica_settings import EjectionRule


class ReplicaHealth:
    """One replica's state. New replicas are ready until a check says otherwise."""

    def __init__(self, rule: EjectionRule) -> None:
        self._rule = rule
        self.is_ready = True
        self.num_failures = 0  # consecutive
        self.num_ejections = 0  # consecutive, for the backoff
        self.ejected_until = 0.0

    def is_available(self, now: float) -> bool:
        return self.is_ready and now >= self.ejected_until

    def is_ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def record_success(self) -> None:
        self.num_failures = 0
        self.num_ejections = 0
        self.ejected_until = 0.0

    def record_failure(self, now: float) -> bool:
        """Count a failed request; True if this failure ejects the replica (a failure while
        it is already ejected, e.g. a request started before, changes nothing)."""
        if self.is_ejected(now):
            return False
        self.num_failures += 1
        if self.num_failures < self._rule.failures_to_eject:
            return False
        self.num_ejections += 1
        self.ejected_until = now + self._rule.backoff(self.num_ejections)
        return True
