"""The ``rollouts:`` table: public model names served by weighted versions, replaceable live.

::

    models:
      large-v1: {upstreams: [...], context_window: 8192, upstream_model: meta-llama/...}
      large-v2: {upstreams: [...], context_window: 8192, prices: {...}}
    rollouts:
      large: {large-v1: 95, large-v2: 5}

Each version is a model entry of its own (upstreams, prices, context window, checkpoint,
``upstream_model``); the rollout's name is what clients send and see (``/v1/models``, the
answers' ``model`` field), the version only shows in the ``x-tollway-model-version`` header,
the usage record and the metrics. A version's own name stays callable (pinning one version,
e.g. for an eval), but ``/v1/models`` does not list it.

The table is the one setting that changes while the gateway runs (`LiveRollouts`, swapped
whole by the config reload, `gateway.launcher.config_reload`): its rollout names are fixed at
start-up, so the names clients may send never change without a restart, while the versions
and weights behind each name do.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from policies.version_choice import Rollout, choose_version, sticky_key

RolloutTable = Mapping[str, Rollout]


def parse_rollouts(raw: Any) -> dict[str, Rollout]:
    """``rollouts:`` from YAML: ``{name: {version: weight, ...}, ...}`` (null: none)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("`rollouts:` must map a public model name to {version: weight, ...}")
    rollouts: dict[str, Rollout] = {}
    for name, weights in raw.items():
        if not isinstance(weights, dict):
            raise ValueError(
                f"rollout {name!r} must map its versions (models under `models:`) to integer "
                f"weights, e.g. {{{name}-v1: 95, {name}-v2: 5}}"
            )
        rollouts[str(name)] = Rollout(str(name), {str(v): w for v, w in weights.items()})
    return rollouts


def check_rollouts(
    rollouts: RolloutTable, models: Collection[str], aliases: Collection[str]
) -> None:
    """Raise ``ValueError`` unless every rollout's name is new and its versions are models."""
    for name, rollout in rollouts.items():
        if name in models:
            raise ValueError(
                f"{name!r} is both a model and a rollout: rename the model entry (e.g. "
                f"{name}-v1) and list it as a version of the rollout"
            )
        if name in aliases:
            raise ValueError(f"{name!r} is both a routing alias and a rollout")
        for version in rollout.weights:
            if version not in models:
                raise ValueError(
                    f"rollout {name!r} names version {version!r}, which is not under "
                    f"`models:` (known: {', '.join(sorted(models))})"
                )


def resolve_version(table: RolloutTable, model: str, tenant_id: str, user: str | None) -> str:
    """The model entry that serves ``model`` for this caller: a rollout's version, chosen by
    `choose_version`, or ``model`` itself."""
    rollout = table.get(model)
    if rollout is None:
        return model
    return choose_version(rollout, sticky_key(tenant_id, user))


def version_names(rollouts: RolloutTable) -> frozenset[str]:
    return frozenset(v for rollout in rollouts.values() for v in rollout.weights)


class LiveRollouts:
    """The rollout table in force. ``replace`` swaps it whole (one reference assignment:
    a request sees the old table or the new one, never a mix)."""

    def __init__(self, table: RolloutTable) -> None:
        self._table: RolloutTable = MappingProxyType(dict(table))

    @property
    def table(self) -> RolloutTable:
        return self._table

    def replace(self, table: RolloutTable) -> None:
        if set(table) != set(self._table):
            raise ValueError(
                f"adding or removing a rollout needs a restart (running: "
                f"{', '.join(sorted(self._table)) or 'none'}; new: "
                f"{', '.join(sorted(table)) or 'none'})"
            )
        self._table = MappingProxyType(dict(table))
