"""A 1 MiB prompt made of one word is refused without stalling the gateway's event loop.

Long prompts are refused on both endpoints, for a plain model and for ``auto``, whether the
gateway refuses them by their length alone (2048-token windows) or tokenizes them (windows of
4 Mi tokens: counted off the event loop, then refused by the 2048-token engine). While one is
being tokenized (the test holds its tokenizer there), ``/health`` is answered. Before, the
routing heuristics backtracked quadratically on one long word (16 k characters blocked every
request for about 10 s) and completions prompts were tokenized on the event loop.

How fast ``/health`` stays while long prompts keep arriving is a benchmark's question, not a
test's: ``python -m bench.health_under_long_prompts`` measures its p99 against the 100 ms
the issue set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission.token_counter import exact_counter
from gateway.settings import GatewaySettings
from tests.gateway.request_path.conftest import CONTEXT_WINDOW, LARGE, SMALL, Engines
from tests.support.stand_in_stack import tenant_key

ONE_MIB = 1 << 20
HANG_S = 60.0  # a wait that ends only if something hangs: the failure, not a time limit


def long_prompt_settings(
    engines: Engines, data_dir: Path, db_url: str, context_window: int
) -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "data_dir": str(data_dir),
            "database_url": db_url,
            "max_body_bytes": 2 * ONE_MIB,  # room for a 1 MiB prompt and its JSON
            "models": {
                name: {
                    "upstreams": [f"unix:{path}"],
                    "context_window": context_window,
                    "checkpoint": str(engines.checkpoint),
                }
                for name, path in engines.sockets.items()
            },
            "routing": {"aliases": {"auto": {"small": SMALL, "large": LARGE}}},
        }
    )


def one_mib_request(path: str, model: str) -> dict[str, Any]:
    word = "a" * ONE_MIB
    if path == "/v1/completions":
        return {"model": model, "prompt": word}
    return {"model": model, "messages": [{"role": "user", "content": word}]}


@pytest.mark.parametrize(
    "context_window", [CONTEXT_WINDOW, 4 * ONE_MIB], ids=["refused-by-length", "tokenized"]
)
def test_one_mib_words_are_refused_on_both_endpoints(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    context_window: int,
) -> None:
    base = gateway(long_prompt_settings(engines, tmp_path / "gw", db_url, context_window))
    _, key = tenant_key(db_url)
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, headers=headers, timeout=HANG_S) as client:
        for model in (SMALL, "auto"):
            for path in ("/v1/completions", "/v1/chat/completions"):
                answer = client.post(path, json=one_mib_request(path, model))
                assert answer.status_code == 400, (path, model, answer.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_health_is_answered_while_a_long_prompt_is_tokenized(
    engines: Engines,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    tokenizing, release = threading.Event(), threading.Event()
    held_too_long: list[bool] = []
    counter = type(exact_counter(engines.checkpoint))  # the class counting this checkpoint

    def held(tokenize: Callable[..., Any]) -> Callable[..., Any]:
        def tokenize_held(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
            if len(str(text)) >= ONE_MIB:  # only the long prompt waits for the test
                tokenizing.set()
                held_too_long.append(not release.wait(HANG_S))
            return tokenize(self, text, *args, **kwargs)

        return tokenize_held

    for name in ("count_prompt", "count_chat", "tokenize_prompt", "tokenize_chat"):
        monkeypatch.setattr(counter, name, held(getattr(counter, name)))
    base = gateway(long_prompt_settings(engines, tmp_path / "gw", db_url, 4 * ONE_MIB))
    _, key = tenant_key(db_url)
    answers: list[httpx.Response] = []

    def send() -> None:
        headers = {"authorization": f"Bearer {key}"}
        answers.append(
            httpx.post(
                base + path, json=one_mib_request(path, SMALL), headers=headers, timeout=HANG_S
            )
        )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert tokenizing.wait(HANG_S), "the long prompt never reached its tokenizer"
        health = httpx.get(base + "/health", timeout=2 * HANG_S)
    finally:
        release.set()
        sender.join(timeout=2 * HANG_S)
    assert health.status_code == 200
    assert held_too_long == [False], "/health waited for the tokenizer: it ran on the event loop"
    (answer,) = answers
    assert answer.status_code == 400, answer.text
