"""The ``/kv_events`` lines: every kind round-trips, the bytes are the format engines and
gateways already speak, and every malformed line is one `KvEventLineError`."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from engine_protocol.block_hash import hash_block
from engine_protocol.kv_events import (
    PING,
    ClearedLine,
    EvictedLine,
    KvEventLine,
    KvEventLineError,
    LoadLine,
    PingLine,
    SnapshotLine,
    StoredLine,
    UnknownLineType,
    decode,
    encode,
)

KEY = b"\x07" * 16
H0 = hash_block(None, [1, 2, 3, 4], KEY)
H1 = hash_block(H0, [5, 6, 7, 8], KEY)
H2 = hash_block(None, [9, 9, 9, 9], KEY)

LINES: list[KvEventLine] = [
    SnapshotLine("e1", 7, 16, KEY, (H0, H1, H2)),
    SnapshotLine("e1", 0, 1, b"", ()),
    StoredLine(8, (H0, H1)),
    EvictedLine(9, (H1,)),
    ClearedLine(10),
    LoadLine(0, 1, 3, 512, 40),
    LoadLine(2, 0, 0, 0),  # an older engine's: no num_requests_total
    PING,
]

# What engines wrote before this module (dicts in this order, orjson, a newline): the lines
# above, byte for byte.
OLD_WIRE: list[dict[str, Any]] = [
    {
        "type": "snapshot",
        "engine_id": "e1",
        "seq": 7,
        "block_size": 16,
        "extra_key": KEY.hex(),
        "blocks": [H0.hex(), H1.hex(), H2.hex()],
    },
    {
        "type": "snapshot",
        "engine_id": "e1",
        "seq": 0,
        "block_size": 1,
        "extra_key": "",
        "blocks": [],
    },
    {"type": "stored", "seq": 8, "blocks": [H0.hex(), H1.hex()]},
    {"type": "evicted", "seq": 9, "blocks": [H1.hex()]},
    {"type": "cleared", "seq": 10},
    {
        "type": "load",
        "num_waiting": 0,
        "num_running": 1,
        "kv_blocks_used": 3,
        "kv_blocks_total": 512,
        "num_requests_total": 40,
    },
    {"type": "load", "num_waiting": 2, "num_running": 0, "kv_blocks_used": 0, "kv_blocks_total": 0},
    {"type": "ping"},
]


@pytest.mark.parametrize("line", LINES, ids=lambda line: type(line).__name__)
def test_every_kind_round_trips(line: KvEventLine) -> None:
    data = encode(line)
    assert data.endswith(b"\n")
    assert data.count(b"\n") == 1
    assert decode(data) == line
    assert decode(data.decode()) == line  # text too
    assert decode(data.rstrip(b"\n")) == line  # as a reader cuts it


def test_the_bytes_are_the_old_format() -> None:
    for line, wire in zip(LINES, OLD_WIRE, strict=True):
        assert encode(line) == orjson.dumps(wire) + b"\n", wire["type"]
    assert encode(ClearedLine(3)) == b'{"type":"cleared","seq":3}\n'
    assert encode(PING) == b'{"type":"ping"}\n'
    assert (
        encode(StoredLine(1, (bytes([0xAB, 0x01]),)))
        == b'{"type":"stored","seq":1,"blocks":["ab01"]}\n'
    )
    assert encode(LoadLine(1, 2, 3, 4, 5)) == (
        b'{"type":"load","num_waiting":1,"num_running":2,"kv_blocks_used":3,'
        b'"kv_blocks_total":4,"num_requests_total":5}\n'
    )


def test_old_writers_lines_decode() -> None:
    """Spaced JSON (the test stand-ins' json.dumps) and fields a reader does not know."""
    for line, wire in zip(LINES, OLD_WIRE, strict=True):
        assert decode(json.dumps(wire)) == line
        assert decode(json.dumps({**wire, "added_later": [1, {"x": None}]})) == line


def test_unknown_line_types_are_their_own_error() -> None:
    with pytest.raises(UnknownLineType) as caught:
        decode(b'{"type": "stats", "seq": 11, "whatever": 1}')
    assert caught.value.line_type == "stats"
    assert isinstance(caught.value, KvEventLineError)
    assert isinstance(caught.value, ValueError)


def _snapshot(**changes: Any) -> str:
    return json.dumps({**OLD_WIRE[0], **changes})


def _load(**changes: Any) -> str:
    return json.dumps({**OLD_WIRE[5], **changes})


def _without(wire: dict[str, Any], name: str) -> str:
    return json.dumps({k: v for k, v in wire.items() if k != name})


MALFORMED: list[tuple[str | bytes, str]] = [
    (b"", "not JSON"),
    (b'{"type": "ping"', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'"ping"', "not a JSON object"),
    (b"null", "not a JSON object"),
    (b'{"seq": 1}', "no string 'type'"),
    (b'{"type": 3}', "no string 'type'"),
    (b'{"type": null}', "no string 'type'"),
    *[(_without(OLD_WIRE[0], name), f"without '{name}'") for name in OLD_WIRE[0] if name != "type"],
    *[(_without(OLD_WIRE[2], name), f"without '{name}'") for name in ("seq", "blocks")],
    (_without(OLD_WIRE[3], "blocks"), "without 'blocks'"),
    (b'{"type": "cleared"}', "without 'seq'"),
    *[(_without(OLD_WIRE[5], name), f"without '{name}'") for name in list(OLD_WIRE[5])[1:5]],
    (_snapshot(engine_id=5), "engine_id must be a string"),
    (_snapshot(seq=-1), "seq must be non-negative"),
    (_snapshot(seq="7"), "seq must be an integer"),
    (_snapshot(seq=7.0), "seq must be an integer"),
    (_snapshot(seq=True), "seq must be an integer"),
    (_snapshot(block_size=0), "block_size must be at least 1"),
    (_snapshot(extra_key="xyz"), "extra_key must be a hex string"),
    (_snapshot(extra_key=None), "extra_key must be a hex string"),
    (_snapshot(blocks="ab01"), "blocks must be a list"),
    (_snapshot(blocks=None), "blocks must be a list"),
    (_snapshot(blocks=[H0.hex(), "zz"]), "blocks holds 'zz'"),
    (_snapshot(blocks=["abc"]), "blocks holds 'abc'"),  # odd length
    (_snapshot(blocks=[1234]), "blocks holds 1234"),
    (b'{"type": "stored", "seq": 1, "blocks": ["zz"]}', "malformed stored line"),
    (b'{"type": "evicted", "seq": -2, "blocks": []}', "seq must be non-negative"),
    (b'{"type": "cleared", "seq": null}', "seq must be an integer"),
    (_load(num_waiting="1"), "num_waiting must be an integer"),
    (_load(num_running=-1), "num_running must be non-negative"),
    (_load(kv_blocks_total=1.5), "kv_blocks_total must be an integer"),
    (_load(num_requests_total="40"), "num_requests_total must be an integer"),
    (_load(num_requests_total=-40), "num_requests_total must be non-negative"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED)
def test_malformed_lines_are_one_error(data: str | bytes, message: str) -> None:
    with pytest.raises(KvEventLineError, match=message) as caught:
        decode(data)
    assert not isinstance(caught.value, UnknownLineType)


def test_null_num_requests_total_reads_as_absent() -> None:
    assert decode(_load(num_requests_total=None)) == LoadLine(0, 1, 3, 512)


def test_lines_refuse_impossible_values() -> None:
    with pytest.raises(ValueError, match="seq must be non-negative"):
        StoredLine(-1, ())
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        SnapshotLine("e", 0, 0, KEY, ())
    with pytest.raises(ValueError, match="kv_blocks_used must be non-negative"):
        LoadLine(0, 0, -1, 8)
    with pytest.raises(TypeError, match="not a kv_events line"):
        encode({"type": "ping"})  # type: ignore[arg-type]


def test_kv_usage_is_a_clamped_fraction() -> None:
    assert LoadLine(0, 0, 5, 20).kv_usage == 0.25
    assert LoadLine(0, 0, 30, 20).kv_usage == 1.0
    assert LoadLine(0, 0, 0, 0).kv_usage == 0.0


def test_lines_are_frozen_values() -> None:
    line = StoredLine(1, (H0,))
    with pytest.raises(AttributeError):
        line.seq = 2  # type: ignore[misc]
    assert {PingLine(), PING} == {PING}
    assert hash(StoredLine(1, (H0,))) == hash(line)
