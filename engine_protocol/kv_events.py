"""The lines of an engine's ``GET /kv_events`` stream, typed, with one `encode` and one `decode`.

The engine writes them (`backend_engine.core.kv_event_log`, `backend_engine.server.kv_event_stream`)
and a gateway reads them (`gateway.upstream.kv_event_client`); both import this module, which
imports neither.

The wire format: newline-delimited JSON, one object per line, ``type`` first; block hashes and
the extra key are lowercase hex::

    {"type": "snapshot", "engine_id": "...", "seq": 7, "block_size": 16,
     "extra_key": "...", "blocks": ["...", ...]}       # every hash findable as of seq 7
    {"type": "load", "num_waiting": 0, "num_running": 1, "kv_blocks_used": 3,
     "kv_blocks_total": 512, "num_requests_total": 40}
    {"type": "stored", "seq": 8, "blocks": ["...", ...]}    # became findable
    {"type": "evicted", "seq": 9, "blocks": ["...", ...]}   # no longer findable
    {"type": "cleared", "seq": 10}                           # every hash forgotten at once
    {"type": "ping"}

- **Sequence numbers.** The snapshot comes first and holds every change up to and with its
  ``seq``. Each ``stored``/``evicted``/``cleared`` line's ``seq`` is exactly one more than the
  line's before it, per engine process (named by ``engine_id``; a new process starts again at
  0). A reader that sees any other ``seq`` has lost lines: it drops what it holds and
  subscribes again for a new snapshot. ``load`` and ``ping`` lines have no ``seq``.
- **Hashes.** A block's hash is `engine_protocol.block_hash.hash_block` (parent, token ids,
  extra key): a reader computes a prompt's chain with that same function, seeded with the
  snapshot's ``extra_key``, and matches it against the blocks it holds. The snapshot lists
  its blocks sorted.
- **Load.** Requests waiting and running, KV blocks in use and in the pool, and
  ``num_requests_total``, the requests queued since the engine started (absent from older
  engines: `LoadLine.num_requests_total` is then None, and `encode` leaves it out likewise).
- **Ping.** Sent after 5 s without any other line, so a reader can tell a quiet stream from a
  dead one.
- **Evolving the format.** A reader ignores fields it does not know and skips lines whose
  type it does not know (`decode` raises `UnknownLineType`, a `KvEventLineError` a reader
  catches to skip the line): a newer engine may add fields and kinds of informational line.
  A new kind of cache *change* must take the next ``seq``: an older reader, which skips it,
  then sees a gap at the next change it knows and subscribes again, rather than silently
  holding a wrong set of blocks.

Every other flaw (not JSON, not an object, a missing or mistyped field, a negative count,
bad hex) is a `KvEventLineError`: the stream is not one a reader can follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from engine_protocol.block_hash import BlockHash

MEDIA_TYPE = "application/x-ndjson"


class KvEventLineError(ValueError):
    """A line that is not a valid ``/kv_events`` line."""


class UnknownLineType(KvEventLineError):
    """A well-formed line of a type this reader does not know (a newer engine's): skip it."""

    def __init__(self, line_type: str) -> None:
        super().__init__(f"unknown kv_events line type {line_type!r}")
        self.line_type = line_type


@dataclass(frozen=True, slots=True)
class SnapshotLine:
    """Every hash the engine's prefix cache can find as of ``seq``."""

    engine_id: str
    seq: int
    block_size: int
    extra_key: bytes
    blocks: tuple[BlockHash, ...]

    def __post_init__(self) -> None:
        _check_count("seq", self.seq)
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class StoredLine:
    """``blocks`` became findable."""

    seq: int
    blocks: tuple[BlockHash, ...]

    def __post_init__(self) -> None:
        _check_count("seq", self.seq)


@dataclass(frozen=True, slots=True)
class EvictedLine:
    """``blocks`` are no longer findable."""

    seq: int
    blocks: tuple[BlockHash, ...]

    def __post_init__(self) -> None:
        _check_count("seq", self.seq)


@dataclass(frozen=True, slots=True)
class ClearedLine:
    """Every hash was forgotten at once."""

    seq: int

    def __post_init__(self) -> None:
        _check_count("seq", self.seq)


@dataclass(frozen=True, slots=True)
class LoadLine:
    """The engine's queue and KV memory now."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_requests_total: int | None = None  # queued since the engine started (newer engines)

    def __post_init__(self) -> None:
        _check_count("num_waiting", self.num_waiting)
        _check_count("num_running", self.num_running)
        _check_count("kv_blocks_used", self.kv_blocks_used)
        _check_count("kv_blocks_total", self.kv_blocks_total)
        if self.num_requests_total is not None:
            _check_count("num_requests_total", self.num_requests_total)

    @property
    def kv_usage(self) -> float:
        """The fraction of KV blocks in use, 0.0 to 1.0 (0.0 for an empty pool)."""
        if self.kv_blocks_total <= 0:
            return 0.0
        return min(1.0, self.kv_blocks_used / self.kv_blocks_total)


@dataclass(frozen=True, slots=True)
class PingLine:
    """Nothing happened for a while; the stream is alive."""


ChangeLine = StoredLine | EvictedLine | ClearedLine
KvEventLine = SnapshotLine | StoredLine | EvictedLine | ClearedLine | LoadLine | PingLine

PING = PingLine()


def encode(line: KvEventLine) -> bytes:
    """One line of the stream: a JSON object and a newline (the engine encodes each line once,
    for every subscriber)."""
    return orjson.dumps(_wire_object(line), option=orjson.OPT_APPEND_NEWLINE)


def decode(data: bytes | str) -> KvEventLine:
    """The line ``data`` holds (with or without its newline).

    Raises `UnknownLineType` for a well-formed line of a type not listed here, and
    `KvEventLineError` for anything else that is not a valid line.
    """
    try:
        wire = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise KvEventLineError(f"not JSON: {_excerpt(data)}") from None
    if not isinstance(wire, dict):
        raise KvEventLineError(f"not a JSON object: {_excerpt(data)}")
    line_type = wire.get("type")
    if not isinstance(line_type, str):
        raise KvEventLineError(f"no string 'type': {_excerpt(data)}")
    read = _READERS.get(line_type)
    if read is None:
        raise UnknownLineType(line_type)
    try:
        return read(wire)
    except KeyError as exc:
        raise KvEventLineError(f"a {line_type} line without {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise KvEventLineError(f"a malformed {line_type} line: {exc}") from None


def _wire_object(line: KvEventLine) -> dict[str, Any]:
    if isinstance(line, StoredLine):
        return {"type": "stored", "seq": line.seq, "blocks": [h.hex() for h in line.blocks]}
    if isinstance(line, EvictedLine):
        return {"type": "evicted", "seq": line.seq, "blocks": [h.hex() for h in line.blocks]}
    if isinstance(line, LoadLine):
        wire: dict[str, Any] = {
            "type": "load",
            "num_waiting": line.num_waiting,
            "num_running": line.num_running,
            "kv_blocks_used": line.kv_blocks_used,
            "kv_blocks_total": line.kv_blocks_total,
        }
        if line.num_requests_total is not None:
            wire["num_requests_total"] = line.num_requests_total
        return wire
    if isinstance(line, PingLine):
        return {"type": "ping"}
    if isinstance(line, ClearedLine):
        return {"type": "cleared", "seq": line.seq}
    if isinstance(line, SnapshotLine):
        return {
            "type": "snapshot",
            "engine_id": line.engine_id,
            "seq": line.seq,
            "block_size": line.block_size,
            "extra_key": line.extra_key.hex(),
            "blocks": [h.hex() for h in line.blocks],
        }
    raise TypeError(f"not a kv_events line: {line!r}")


def _read_snapshot(wire: dict[str, Any]) -> SnapshotLine:
    engine_id = wire["engine_id"]
    if not isinstance(engine_id, str):
        raise TypeError(f"engine_id must be a string, got {engine_id!r}")
    return SnapshotLine(
        engine_id=engine_id,
        seq=_int(wire, "seq"),
        block_size=_int(wire, "block_size"),
        extra_key=_hex(wire["extra_key"], "extra_key"),
        blocks=_hashes(wire),
    )


def _read_stored(wire: dict[str, Any]) -> StoredLine:
    return StoredLine(seq=_int(wire, "seq"), blocks=_hashes(wire))


def _read_evicted(wire: dict[str, Any]) -> EvictedLine:
    return EvictedLine(seq=_int(wire, "seq"), blocks=_hashes(wire))


def _read_cleared(wire: dict[str, Any]) -> ClearedLine:
    return ClearedLine(seq=_int(wire, "seq"))


def _read_load(wire: dict[str, Any]) -> LoadLine:
    total = wire.get("num_requests_total")
    return LoadLine(
        num_waiting=_int(wire, "num_waiting"),
        num_running=_int(wire, "num_running"),
        kv_blocks_used=_int(wire, "kv_blocks_used"),
        kv_blocks_total=_int(wire, "kv_blocks_total"),
        num_requests_total=None if total is None else _int(wire, "num_requests_total"),
    )


def _read_ping(wire: dict[str, Any]) -> PingLine:
    return PING


_READERS: dict[str, Callable[[dict[str, Any]], KvEventLine]] = {
    "snapshot": _read_snapshot,
    "stored": _read_stored,
    "evicted": _read_evicted,
    "cleared": _read_cleared,
    "load": _read_load,
    "ping": _read_ping,
}


def _int(wire: dict[str, Any], name: str) -> int:
    value = wire[name]
    if type(value) is not int:  # not a bool, nor a float
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _hashes(wire: dict[str, Any]) -> tuple[BlockHash, ...]:
    blocks = wire["blocks"]
    if not isinstance(blocks, list):
        raise TypeError(f"blocks must be a list of hex strings, got a {type(blocks).__name__}")
    try:
        return tuple(map(bytes.fromhex, blocks))  # TypeError for a non-string
    except (TypeError, ValueError):
        bad = next(h for h in blocks if not _is_hex(h))
        raise ValueError(f"blocks holds {bad!r}, not a hex string") from None


def _hex(value: Any, name: str) -> bytes:
    if not _is_hex(value):
        raise ValueError(f"{name} must be a hex string, got {_excerpt(repr(value))}")
    return bytes.fromhex(value)


def _is_hex(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


def _excerpt(data: bytes | str, limit: int = 80) -> str:
    return repr(data[:limit]) + ("..." if len(data) > limit else "")
