"""Who gets admitted next: priority classes, then preempted requests, then
tenants in turn.

Order of admission:
1. a lower ``Priority`` value first (interactive before batch);
2. within a class, requests that were preempted, oldest first: they keep their
   place ahead of anything that arrived later;
3. otherwise the tenant with the fewest running requests goes first (ties: the
   tenant whose oldest waiting request is oldest), and within a tenant, arrival
   order. One tenant's burst therefore cannot starve another tenant.

A tenant that already runs ``max_running`` requests is passed over while another tenant
waits (the running-share cap): its requests keep their place and come back once nobody
else waits. ``peek`` can also be limited to some tenants: the scheduler admits among
those with some of their share of the step's prefill budget left (:mod:`.prefill_budget`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Iterator, Mapping

from backend_engine.core.request import Request
from backend_engine.request_priority import Priority


class _PriorityClass:
    def __init__(self) -> None:
        self.preempted: deque[Request] = deque()
        self.by_tenant: dict[str, deque[Request]] = {}

    def __len__(self) -> int:
        return len(self.preempted) + sum(len(q) for q in self.by_tenant.values())


class WaitingQueue:
    def __init__(self) -> None:
        self._classes: dict[Priority, _PriorityClass] = {p: _PriorityClass() for p in Priority}
        self._size = 0
        self._num_waiting_by_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for cls in self._classes.values():
            yield from cls.preempted
            for queue in cls.by_tenant.values():
                yield from queue

    def add(self, request: Request) -> None:
        cls = self._classes[request.priority]
        cls.by_tenant.setdefault(request.tenant_id, deque()).append(request)
        self._size += 1
        self._num_waiting_by_tenant[request.tenant_id] += 1

    def add_preempted(self, request: Request) -> None:
        """A preempted request goes back ahead of every later arrival of its class."""
        preempted = self._classes[request.priority].preempted
        index = 0
        while index < len(preempted) and preempted[index].arrival_seq < request.arrival_seq:
            index += 1
        preempted.insert(index, request)
        self._size += 1
        self._num_waiting_by_tenant[request.tenant_id] += 1

    @property
    def tenants(self) -> list[str]:
        """The tenants with a waiting request."""
        return list(self._num_waiting_by_tenant)

    def is_capped(
        self, tenant: str, num_running_by_tenant: Mapping[str, int], max_running: int | None
    ) -> bool:
        """Whether ``tenant`` is passed over: it runs ``max_running`` requests or more while
        another tenant waits."""
        if max_running is None or num_running_by_tenant.get(tenant, 0) < max_running:
            return False
        return len(self._num_waiting_by_tenant) > (tenant in self._num_waiting_by_tenant)

    def of_tenant(self, tenant: str) -> Iterator[Request]:
        """One tenant's waiting requests, in the order ``peek`` gives them."""
        for cls in self._classes.values():
            yield from (r for r in cls.preempted if r.tenant_id == tenant)
            yield from cls.by_tenant.get(tenant, ())

    def peek(
        self,
        num_running_by_tenant: Mapping[str, int],
        *,
        tenants: Container[str] | None = None,
        max_running: int | None = None,
    ) -> Request | None:
        """The request to admit next (see the module docstring), without removing it: of
        ``tenants`` only, if given; none of a tenant capped at ``max_running``."""

        def is_eligible(candidate: str) -> bool:
            if tenants is not None and candidate not in tenants:
                return False
            return not self.is_capped(candidate, num_running_by_tenant, max_running)

        for priority in sorted(self._classes):
            cls = self._classes[priority]
            for request in cls.preempted:
                if is_eligible(request.tenant_id):
                    return request
            best: Request | None = None
            best_key: tuple[int, int] | None = None
            for candidate, queue in cls.by_tenant.items():
                if not is_eligible(candidate):
                    continue
                head = queue[0]
                key = (num_running_by_tenant.get(candidate, 0), head.arrival_seq)
                if best_key is None or key < best_key:
                    best, best_key = head, key
            if best is not None:
                return best
        return None

    def remove(self, request: Request) -> bool:
        cls = self._classes[request.priority]
        if cls.preempted and request in cls.preempted:
            cls.preempted.remove(request)
            self._forget(request)
            return True
        queue = cls.by_tenant.get(request.tenant_id)
        if queue is None or request not in queue:
            return False
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        if not queue:
            del cls.by_tenant[request.tenant_id]
        self._forget(request)
        return True

    def _forget(self, request: Request) -> None:
        self._size -= 1
        self._num_waiting_by_tenant[request.tenant_id] -= 1
        if not self._num_waiting_by_tenant[request.tenant_id]:
            del self._num_waiting_by_tenant[request.tenant_id]
