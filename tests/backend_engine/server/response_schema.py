"""The engine server's tests' way into the one OpenAI response-schema check
(`tests.support.openai_response_schema`): the tests read answers of either endpoint, whole or
streamed, so an answer's kind is the one its ``object`` names; and `checked_client` checks
every non-streamed answer an httpx client receives without the test asking.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from tests.support import openai_response_schema as schema


def check_answer(answer: Mapping[str, Any], *, is_chunk: bool = False) -> None:
    """A whole answer or a stream chunk of either endpoint, checked as the kind its
    ``object`` names (a chunk's object in a whole answer fails); an error event, which a
    stream may end with, is not an answer and is skipped."""
    if "error" in answer:
        return
    schema.check_answer(answer, schema.kind_of(answer, is_chunk=is_chunk))


def check_response(response: httpx.Response) -> None:
    """An httpx response hook: a non-streamed 200 answer of either endpoint is checked
    (streams are checked chunk by chunk where their events are read)."""
    path = response.request.url.path
    is_generation = path.endswith(("/chat/completions", "/completions"))
    content_type = response.headers.get("content-type", "")
    if is_generation and response.status_code == 200 and content_type == "application/json":
        response.read()
        check_answer(json.loads(response.content))


def checked_client(base_url: str, **kwargs: Any) -> httpx.Client:
    """An httpx client whose every non-streamed answer is checked."""
    return httpx.Client(base_url=base_url, event_hooks={"response": [check_response]}, **kwargs)
