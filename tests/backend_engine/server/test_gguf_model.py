"""``tollway engine --model FILE.gguf`` answers over HTTP: the engine's server on the
shipped SmolLM2-135M-Instruct GGUF, its chat template and tokenizer from the file's
metadata, gives the README's answer."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app, uvicorn_config
from tests.backend_engine.server.response_schema import check_answer
from tests.support.uvicorn_thread import start_in_thread, stop_thread


def test_the_real_model_answers_a_chat_over_http(smollm2_gguf: Path) -> None:
    config = EngineConfig(model=str(smollm2_gguf), num_kv_blocks=64, show_progress=False)
    engine = AsyncEngine(config, model_name="smollm2")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "smollm2",
                "temperature": 0,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            timeout=120,
        )
    finally:
        stop_thread(server, thread)
        sock.close()
    assert response.status_code == 200, response.text
    body = response.json()
    check_answer(body)
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"  # <|im_end|>, from the metadata
    # The default system prompt of the file's chat template, then the question: 37 tokens.
    assert body["usage"]["prompt_tokens"] == 37
