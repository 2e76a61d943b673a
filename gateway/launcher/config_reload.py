"""Rollout weights change without a restart: ``tollway serve --config`` watches its file.

Why a config reload and not the admin API: in Kubernetes every gateway replica reads the same
ConfigMap, so one edit (``kubectl apply``) reaches them all, is reviewed and versioned like the
rest of the config, and needs no new state. An admin API would have to store the table in the
database and tell every replica of each change (cross-replica invalidation, as the auth epochs
do for keys), and the ConfigMap would then disagree with what runs.

::

    every CONFIG_POLL_INTERVAL_S: read the file; unchanged bytes -> nothing
      not YAML / not a mapping / bad rollouts / a rollout added or removed
                      -> log why, keep the table in force
      else            -> swap in the new `rollouts:` table whole (LiveRollouts.replace)
      anything else changed since start-up -> log that it needs a restart (not applied)

Each rollout whose weights a reload changed is written to the audit log (`audit_rollouts`:
action ``rollout.weights_changed``, actor ``config-file:<file name>``, the weights before and
after), once per gateway replica that applied it: every replica reads the file on its own.

Polling, not inotify: a ConfigMap volume updates by swapping a symlink, which a watch on the
file misses, and a read of a small file per second costs nothing. The kubelet takes up to
about a minute to update the volume, so every replica applies an edit within a minute or so
of the others; a tenant may meanwhile be served by two versions on two replicas.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from gateway.rollouts import LiveRollouts, RolloutTable, check_rollouts, parse_rollouts
from gateway.settings import GatewaySettings
from gateway.storage import audit_log
from gateway.storage.database import Database
from gateway.storage.models import utc_now

logger = logging.getLogger(__name__)

CONFIG_POLL_INTERVAL_S = 1.0

OnApplied = Callable[[RolloutTable, RolloutTable], None]  # (before, after), once applied


class RolloutReloader:
    """Applies the ``rollouts:`` of ``path`` to ``live`` whenever the file changes."""

    def __init__(
        self,
        path: Path,
        live: LiveRollouts,
        settings: GatewaySettings,
        on_applied: OnApplied | None = None,
    ) -> None:
        """``on_applied``: told of each new table applied (the audit log); its failure is
        logged and changes nothing."""
        self._path = path
        self._live = live
        self._on_applied = on_applied
        self._models = frozenset(settings.models)
        self._aliases = frozenset(settings.routing.aliases if settings.routing else ())
        self._seen = self._read_bytes()
        self._started_with = _without_rollouts(_load(self._seen)) if self._seen else None

    def check(self) -> bool:
        """Read the file once; True if a new rollout table was applied."""
        text = self._read_bytes()
        if text is None or text == self._seen:
            return False
        self._seen = text
        before = self._live.table
        try:
            raw = _load(text)
            table = parse_rollouts(raw.get("rollouts"))
            check_rollouts(table, self._models, self._aliases)
            is_new = _weights(table) != _weights(self._live.table)
            self._live.replace(table)
        except (ValueError, yaml.YAMLError) as exc:
            logger.warning(
                "config reload: %s: %s; the rollouts in force stay (%s)",
                self._path,
                _one_line(exc),
                _describe(self._live.table),
            )
            return False
        others = _changed_keys(self._started_with, _without_rollouts(raw))
        if others:
            logger.warning(
                "config reload: %s: changes to %s need a restart and were not applied",
                self._path,
                ", ".join(others),
            )
        if is_new:
            logger.warning("config reload: rollouts now %s", _describe(table))
            if self._on_applied is not None:
                try:
                    self._on_applied(before, table)
                except Exception:  # the new weights are in force either way
                    logger.exception("config reload: recording the change failed")
        return is_new

    def _read_bytes(self) -> bytes | None:
        try:
            return self._path.read_bytes()
        except OSError as exc:  # mid-swap, or removed: the next poll looks again
            logger.warning("config reload: cannot read %s: %s", self._path, exc)
            return None


@contextmanager
def watching_rollouts(
    path: Path,
    live: LiveRollouts,
    settings: GatewaySettings,
    interval_s: float = CONFIG_POLL_INTERVAL_S,
    on_applied: OnApplied | None = None,
) -> Iterator[RolloutReloader]:
    """A thread polls ``path`` every ``interval_s`` until the block ends."""
    reloader = RolloutReloader(path, live, settings, on_applied)
    stopping = threading.Event()

    def poll() -> None:
        while not stopping.wait(interval_s):
            try:
                reloader.check()
            except Exception:  # never let a reload take the gateway down
                logger.exception("config reload failed; the rollouts in force stay")

    thread = threading.Thread(target=poll, name="tollway-config-reload", daemon=True)
    thread.start()
    try:
        yield reloader
    finally:
        stopping.set()
        thread.join(timeout=5)


def audit_rollouts(database: Database, path: Path) -> OnApplied:
    """Write each rollout whose weights changed to the audit log, in one transaction."""
    actor = f"config-file:{path.name}"

    def record(before: RolloutTable, after: RolloutTable) -> None:
        old, new = _weights(before), _weights(after)
        now = utc_now()
        with database.transaction() as session:
            for name in sorted(name for name in new if new[name] != old.get(name)):
                audit_log.record_change(
                    session,
                    actor=actor,
                    action="rollout.weights_changed",
                    target_type="rollout",
                    target_id=name,
                    tenant_id=None,
                    before={"weights": old[name]} if name in old else None,
                    after={"weights": new[name]},
                    now=now,
                )

    return record


def _load(text: bytes) -> dict[str, Any]:
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ValueError("expected a mapping at the top level")
    return raw


def _without_rollouts(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != "rollouts"}


def _changed_keys(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str]:
    if before is None:
        return []
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def _weights(table: RolloutTable) -> dict[str, dict[str, int]]:
    return {name: dict(rollout.weights) for name, rollout in table.items()}


def _describe(table: RolloutTable) -> str:
    if not table:
        return "none"
    return "; ".join(
        f"{name}: " + ", ".join(f"{v} {w}" for v, w in rollout.weights.items())
        for name, rollout in sorted(table.items())
    )


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
