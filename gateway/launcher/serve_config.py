"""What ``tollway serve`` runs: the gateway's settings and the engines it spawns itself.

Two sources, one result (`ServePlan`):

- **embedded default** (no ``--config``): models ``small`` and ``large``, both
  SmolLM2-135M-Instruct (`gateway.launcher.bundled_model`; the random demo checkpoints in
  ``DATA/models`` without it), each served by a child engine on ``DATA/run/<name>.sock``;
  alias ``auto`` routes between them; SQLite in ``DATA``; budgets and rate limits in process.
- **a YAML file** (``--config``): `GatewaySettings`' format, plus one optional field per
  model, ``spawn:``, for an engine that ``tollway serve`` starts on this machine::

      models:
        small:
          spawn: {checkpoint: /models/llama-3.2-1b, device: cuda, args: [--dtype, bfloat16]}
          # or a GGUF file: spawn: {checkpoint: /models/qwen2.5-0.5b-instruct-q8_0.gguf}
          # quantized at load: spawn: {checkpoint: ..., quantization: int4,
          #                             quantization_group_size: 64, kv_cache_dtype: int8}
          # speculative decoding: spawn: {checkpoint: ..., speculative_proposer: ngram,
          #                               num_speculative_tokens: 4}
          upstreams: [http://10.0.0.2:8100]   # optional: more replicas besides the local one
          prices: {input: 100, cached_input: 10, output: 400}

  A spawned engine's socket is put first in ``upstreams``; ``checkpoint`` and
  ``context_window`` default to the spawned checkpoint's, a Hugging Face directory or a
  ``.gguf`` file, which is checked here (config, tokenizer, tensor types) so that a file the
  engine would refuse is refused before anything starts. Models without ``spawn:`` are remote
  engines that must already be running. ``quantization`` (int8 | int4),
  ``quantization_group_size`` (32 | 64, int4 only) and ``kv_cache_dtype`` (auto | int8) are
  checked here and become the engine's ``--quantization``, ``--quantization-group-size`` and
  ``--kv-cache-dtype``. So are speculative decoding's ``speculative_proposer`` (ngram | draft),
  ``speculative_draft_model`` (draft only: a checkpoint, relative to the file like
  ``checkpoint``, checked the same way), ``num_speculative_tokens``,
  ``speculative_ngram_min`` and ``speculative_ngram_max`` (ngram only, min <= max) and
  ``speculative_crossover_batch_size`` (each at least 1; all need ``speculative_proposer``);
  other engine flags go in ``args``.

In both cases ``TOLLWAY_*`` environment variables override the scalar settings, and the
``--host``/``--port``/``--data-dir`` flags override both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gateway.defaults import DEFAULT_DATA_DIR
from gateway.launcher.engine_processes import (
    DEFAULT_SPECULATIVE_NGRAM_MAX,
    DEFAULT_SPECULATIVE_NGRAM_MIN,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    MAX_SOCKET_PATH_BYTES,
    QUANTIZATIONS,
    SPECULATIVE_PROPOSERS,
    EngineSpec,
    SpeculativeSpec,
)
from gateway.settings import GatewaySettings
from model_files.checkpoint import Checkpoint

# Micros of currency per million tokens (input, cached input, output).
DEMO_PRICES: Mapping[str, Mapping[str, int]] = {
    "small": {"input": 100, "cached_input": 10, "output": 400},
    "large": {"input": 1000, "cached_input": 100, "output": 4000},
}
AUTO_ALIAS = "auto"
SPAWN_KEYS = (
    "checkpoint",
    "device",
    "quantization",
    "quantization_group_size",
    "kv_cache_dtype",
    "speculative_proposer",
    "speculative_draft_model",
    "num_speculative_tokens",
    "speculative_ngram_min",
    "speculative_ngram_max",
    "speculative_crossover_batch_size",
    "args",
)
_SPECULATIVE_COUNTS = (
    "num_speculative_tokens",
    "speculative_ngram_min",
    "speculative_ngram_max",
    "speculative_crossover_batch_size",
)
_Choice = TypeVar("_Choice", str, int)


@dataclass(frozen=True)
class ServePlan:
    settings: GatewaySettings
    engines: tuple[EngineSpec, ...]

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"


def context_window(checkpoint: Path) -> int:
    """The longest sequence the engine will serve for this checkpoint (a Hugging Face
    directory or a GGUF file), checked first as far as it can be without loading it."""
    return Checkpoint(checkpoint).check().max_model_len


def socket_dir(data_dir: Path) -> Path:
    """``DATA/run``, or a private directory under the temp dir if that path is too long."""
    run = data_dir.resolve() / "run"
    if len(os.fsencode(run / "some-model-name.sock")) <= MAX_SOCKET_PATH_BYTES:
        return run
    digest = hashlib.sha256(os.fsencode(run)).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"tollway-{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    return short


def engine_threads(num_engines: int) -> dict[str, str]:
    """Split the CPU cores between CPU engines, unless the user set ``OMP_NUM_THREADS``."""
    if "OMP_NUM_THREADS" in os.environ or num_engines < 1:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_engines))}


def embedded_plan(
    data_dir: Path,
    checkpoints: Mapping[str, Path],
    env: Mapping[str, str] = os.environ,
) -> ServePlan:
    """The embedded default over ``checkpoints`` (``small`` and ``large``)."""
    data_dir = data_dir.resolve()
    sockets = socket_dir(data_dir)
    threads = engine_threads(len(checkpoints))
    engines = tuple(
        EngineSpec(name, path.resolve(), sockets / f"{name}.sock", env=threads)
        for name, path in checkpoints.items()
    )
    # Once per file: both models may serve the same one, and a GGUF file takes seconds to open.
    windows = {path: context_window(path) for path in {spec.checkpoint for spec in engines}}
    models = {
        spec.name: {
            "upstreams": [f"unix:{spec.socket_path}"],
            "context_window": windows[spec.checkpoint],
            "checkpoint": str(spec.checkpoint),
            "prices": dict(DEMO_PRICES.get(spec.name, {})),
        }
        for spec in engines
    }
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "models": models,
    }
    if {"small", "large"} <= models.keys():
        data["routing"] = {"aliases": {AUTO_ALIAS: {"small": "small", "large": "large"}}}
    settings = GatewaySettings.from_dict(data, env=_without_data_dir(env))
    return ServePlan(settings=settings, engines=engines)


def config_plan(
    path: Path, data_dir: Path | None, env: Mapping[str, str] = os.environ
) -> ServePlan:
    """The plan for a YAML config; ``data_dir`` (flag or ``TOLLWAY_DATA_DIR``) overrides its own."""
    base_dir = path.resolve().parent
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if data_dir is None:
        data_dir = base_dir / Path(str(raw.get("data_dir") or DEFAULT_DATA_DIR))
    data_dir = data_dir.resolve()
    data = {**raw, "data_dir": str(data_dir)}
    raw_models = raw.get("models")
    engines: list[EngineSpec] = []
    if isinstance(raw_models, dict):
        data["models"], engines = _spawned_models(raw_models, base_dir, socket_dir(data_dir))
    threads = engine_threads(sum(spec.device == "cpu" for spec in engines))
    engines = [
        dataclasses.replace(spec, env=threads) if spec.device == "cpu" else spec for spec in engines
    ]
    try:
        settings = GatewaySettings.from_dict(data, env=_without_data_dir(env), base_dir=base_dir)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return ServePlan(settings=settings, engines=tuple(engines))


def with_address(plan: ServePlan, host: str | None, port: int | None) -> ServePlan:
    """The plan with the ``--host``/``--port`` flags applied."""
    changes: dict[str, Any] = {}
    if host is not None:
        changes["host"] = host
    if port is not None:
        changes["port"] = port
    if not changes:
        return plan
    return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, **changes))


def _spawned_models(
    raw_models: Mapping[str, Any], base_dir: Path, sockets: Path
) -> tuple[dict[str, Any], list[EngineSpec]]:
    models: dict[str, Any] = {}
    engines: list[EngineSpec] = []
    for name, spec in raw_models.items():
        if not isinstance(spec, dict) or "spawn" not in spec:
            models[name] = spec
            continue
        spec = dict(spec)
        spawn = spec.pop("spawn")
        engine = _engine_spec(str(name), spawn, base_dir, sockets)
        upstreams = spec.get("upstreams") or []
        if isinstance(upstreams, str):
            upstreams = [upstreams]
        spec["upstreams"] = [f"unix:{engine.socket_path}", *upstreams]
        spec.setdefault("checkpoint", str(engine.checkpoint))
        try:
            window = context_window(engine.checkpoint)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"model {name!r}: spawn checkpoint: {exc}") from None
        spec.setdefault("context_window", window)
        if engine.speculative and engine.speculative.speculative_draft_model:
            try:
                Checkpoint(engine.speculative.speculative_draft_model).check()
            except (FileNotFoundError, ValueError) as exc:
                raise ValueError(f"model {name!r}: spawn.speculative_draft_model: {exc}") from None
        models[name] = spec
        engines.append(engine)
    return models, engines


def _engine_spec(name: str, spawn: Any, base_dir: Path, sockets: Path) -> EngineSpec:
    if not isinstance(spawn, dict) or not spawn.get("checkpoint"):
        raise ValueError(f"model {name!r}: spawn needs at least {{checkpoint: DIR_OR_GGUF}}")
    extra = sorted(set(spawn) - set(SPAWN_KEYS))
    if extra:
        raise ValueError(f"model {name!r}: spawn takes {', '.join(SPAWN_KEYS)}, not {extra}")
    checkpoint = (base_dir / Path(str(spawn["checkpoint"]))).resolve()
    args = spawn.get("args") or []
    if not isinstance(args, list):
        raise ValueError(f"model {name!r}: spawn.args must be a list of engine flags")
    extra_args = tuple(str(a) for a in args)
    quantization = _choice(name, spawn, "quantization", QUANTIZATIONS, extra_args)
    group_size = _choice(name, spawn, "quantization_group_size", INT4_GROUP_SIZES, extra_args)
    if group_size is not None and quantization != "int4":
        raise ValueError(
            f"model {name!r}: spawn.quantization_group_size applies to quantization: int4 only"
        )
    return EngineSpec(
        name=name,
        checkpoint=checkpoint,
        socket_path=sockets / f"{name}.sock",
        device=str(spawn.get("device") or "cpu"),
        quantization=quantization,
        quantization_group_size=group_size,
        kv_cache_dtype=_choice(name, spawn, "kv_cache_dtype", KV_CACHE_DTYPES, extra_args),
        speculative=_speculative_spec(name, spawn, base_dir, extra_args),
        extra_args=extra_args,
    )


def _speculative_spec(
    name: str, spawn: Mapping[str, Any], base_dir: Path, extra_args: tuple[str, ...]
) -> SpeculativeSpec | None:
    """``spawn``'s speculative decoding keys, checked as `EngineConfig` checks them; None
    when it sets none (the engine does not speculate, unless ``args`` says so)."""
    proposer = _choice(name, spawn, "speculative_proposer", SPECULATIVE_PROPOSERS, extra_args)
    counts = {key: _count(name, spawn, key, extra_args) for key in _SPECULATIVE_COUNTS}
    draft_model = spawn.get("speculative_draft_model")
    if proposer is None:
        for key in (*_SPECULATIVE_COUNTS, "speculative_draft_model"):
            if spawn.get(key) is not None:
                raise ValueError(f"model {name!r}: spawn.{key} needs spawn.speculative_proposer")
        return None
    if (proposer == "draft") != (draft_model is not None):
        raise ValueError(
            f"model {name!r}: spawn.speculative_draft_model (a checkpoint) is needed by, and "
            "only by, speculative_proposer: draft"
        )
    for key in ("speculative_ngram_min", "speculative_ngram_max"):
        if proposer != "ngram" and counts[key] is not None:
            raise ValueError(f"model {name!r}: spawn.{key} applies to speculative_proposer: ngram")
    ngram_min = counts["speculative_ngram_min"] or DEFAULT_SPECULATIVE_NGRAM_MIN
    ngram_max = counts["speculative_ngram_max"] or DEFAULT_SPECULATIVE_NGRAM_MAX
    if ngram_min > ngram_max:
        raise ValueError(
            f"model {name!r}: spawn.speculative_ngram_min ({ngram_min}) must be at most "
            f"speculative_ngram_max ({ngram_max})"
        )
    draft_path = None
    if draft_model is not None:
        if not isinstance(draft_model, str) or not draft_model:
            raise ValueError(
                f"model {name!r}: spawn.speculative_draft_model must be a checkpoint's path, "
                f"got {draft_model!r}"
            )
        _refuse_twice(name, "speculative_draft_model", extra_args)
        draft_path = (base_dir / Path(draft_model)).resolve()
    return SpeculativeSpec(proposer, draft_path, **counts)


def _choice(
    name: str,
    spawn: Mapping[str, Any],
    key: str,
    choices: tuple[_Choice, ...],
    extra_args: tuple[str, ...],
) -> _Choice | None:
    """``spawn[key]``, one of ``choices``, or ``None`` when absent."""
    value = spawn.get(key)
    if value is None:
        return None
    if value not in choices or isinstance(value, bool):
        allowed = ", ".join(str(c) for c in choices)
        raise ValueError(f"model {name!r}: spawn.{key} must be one of {allowed}, got {value!r}")
    _refuse_twice(name, key, extra_args)
    return value  # type: ignore[no-any-return]


def _count(
    name: str, spawn: Mapping[str, Any], key: str, extra_args: tuple[str, ...]
) -> int | None:
    """``spawn[key]``, a whole number at least 1, or ``None`` when absent."""
    value = spawn.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"model {name!r}: spawn.{key} must be a whole number of at least 1, got {value!r}"
        )
    _refuse_twice(name, key, extra_args)
    return value


def _refuse_twice(name: str, key: str, extra_args: tuple[str, ...]) -> None:
    """A setting given both as ``spawn.KEY`` and as its flag in ``spawn.args`` is refused
    (which of the two would the engine take?)."""
    flag = "--" + key.replace("_", "-")
    if any(arg == flag or arg.startswith(flag + "=") for arg in extra_args):
        raise ValueError(f"model {name!r}: give {key} once, as spawn.{key} or {flag} in args")


def _without_data_dir(env: Mapping[str, str]) -> dict[str, str]:
    """``TOLLWAY_DATA_DIR`` is already applied (relative to the working directory)."""
    return {k: v for k, v in env.items() if k != "TOLLWAY_DATA_DIR"}
