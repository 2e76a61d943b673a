"""What reading a completion body costs the gateway: parsing and the field rules, per body.

    python -m bench.request_parsing            # 20,000 calls per measurement, best of 5

Compares, on a typical 1.6 KB chat body, the standard library's ``json.loads`` (what the
gateway used before the nesting cap) with ``json_body.parse_json_object`` (orjson, a
bracket count for the depth cap, and the proof that no key is given twice), then times the
field table (``check_fields``) and the gateway's whole ``parse_body``. A body deeper than
the cap is timed too, to show a refusal is cheap. Numbers vary with the machine's load:
compare lines of one run.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from typing import Any

from gateway.api.request_body import parse_body
from openai_protocol.field_rules import FieldError, check_fields
from openai_protocol.json_body import parse_json_object

TYPICAL: dict[str, Any] = {
    "model": "small",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 10},
        {"role": "user", "content": "Summarise this text: " + "lorem ipsum dolor sit amet " * 40},
    ],
    "temperature": 0.7,
    "top_p": 0.9,
    "max_tokens": 256,
    "stream": True,
    "stream_options": {"include_usage": True},
    "seed": 42,
    "stop": ["\n\n"],
}


def _best_us(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def _refused(body: bytes) -> None:
    try:
        parse_json_object(body)
    except FieldError:
        return
    raise AssertionError("a too-deep body was accepted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()
    body = json.dumps(TYPICAL).encode()
    data = parse_json_object(body)
    deep = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    rows = [
        ("json.loads (before)", lambda: json.loads(body), args.number),
        (
            "parse_json_object (orjson, depth, dup keys)",
            lambda: parse_json_object(body),
            args.number,
        ),
        ("check_fields (the field table)", lambda: check_fields(data, "chat"), args.number),
        ("gateway parse_body (table + messages)", lambda: parse_body(data, "chat"), args.number),
        ("refusing a 100,000-deep body (200 KB)", lambda: _refused(deep), 200),
    ]
    print(f"typical chat body: {len(body)} bytes")
    for name, call, number in rows:
        print(f"{name:44s} {_best_us(call, number):9.2f} us")


if __name__ == "__main__":
    main()
