"""The engine's loop runs behind any `StepRunner`: the KV cache is sized by the plan, each
sampled token comes from the runner, and without the model's runner nothing imports torch.

The runner here is the tests' stand-in (`tests.support.stand_in_runner`), the one the gateway-only
environment serves its engines with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend_engine.config import EngineConfig
from backend_engine.llm_engine import LLMEngine
from backend_engine.sampling_params import SamplingParams
from tests.support.stand_in_runner import StandInPlan, StandInRunner, plan_stand_in_runner
from tests.support.without_engine import REPO_ROOT, run_without_engine


def _engine(checkpoint: Path, **config: Any) -> LLMEngine:
    engine_config = EngineConfig(model=str(checkpoint), show_progress=False, **config)
    return LLMEngine(engine_config, plan_stand_in_runner(step_s=0))


def _generate(
    engine: LLMEngine, prompts: dict[str, str], params: SamplingParams
) -> dict[str, tuple[list[int], str | None]]:
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    reasons: dict[str, str | None] = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    return {rid: (outputs[rid], reasons[rid]) for rid in prompts}


def test_the_plan_sizes_the_kv_cache_and_builds_the_runner(
    demo_model_files: Callable[..., Path],
) -> None:
    engine = _engine(demo_model_files(size="tiny"), kv_cache_memory_bytes=1 << 20)
    assert isinstance(engine.runner, StandInRunner)
    plan = StandInPlan(engine.model_config, block_size=16, step_s=0)
    assert engine.kv_cache.num_blocks == (1 << 20) // plan.kv_bytes_per_block


def test_every_sampled_token_comes_from_the_runner_and_runs_to_max_tokens(
    demo_model_files: Callable[..., Path],
) -> None:
    engine = _engine(demo_model_files(size="tiny"), max_num_batched_tokens=8)  # chunked
    prompts = {"a": "Once upon a time there was a cat", "b": "Hi"}
    outcomes = _generate(engine, prompts, SamplingParams(max_tokens=7, temperature=0.8, seed=1))
    words = engine.runner.words
    for rid, prompt in prompts.items():
        tokens, reason = outcomes[rid]
        start = len(engine.tokenize(prompt))  # the first sampled token's position
        assert tokens == [words[(start + i) % len(words)] for i in range(7)]
        assert reason == "length"
    assert engine.stats().num_generation_tokens == 14


def test_with_a_stand_in_runner_the_engine_and_its_server_need_no_torch(
    demo_model_files: Callable[..., Path],
) -> None:
    checkpoint = demo_model_files(size="tiny")
    code = """
import sys
from starlette.testclient import TestClient
from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from tests.support.stand_in_runner import plan_stand_in_runner

config = EngineConfig(model=sys.argv[1], show_progress=False)
engine = AsyncEngine(config, model_name="tiny", plan_runner=plan_stand_in_runner())
with TestClient(build_app(engine)) as client:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
    answer = client.post("/v1/completions", json=body)
assert answer.status_code == 200, answer.text
assert answer.json()["usage"]["completion_tokens"] == 3
assert not any(m.partition(".")[0] in {"torch", "triton", "safetensors"} for m in sys.modules)
print("served")
"""
    result = run_without_engine(code, str(checkpoint), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "served"


def test_the_torch_free_check_would_catch_the_model_runner(
    demo_model_files: Callable[..., Path],
) -> None:
    """Without a plan the engine builds the model's runner, which needs torch: refused there."""
    code = """
import sys
from backend_engine.config import EngineConfig
from backend_engine.llm_engine import LLMEngine
LLMEngine(EngineConfig(model=sys.argv[1], show_progress=False))
"""
    result = run_without_engine(code, str(demo_model_files(size="tiny")), cwd=REPO_ROOT)
    assert result.returncode != 0
    assert "No module named 'torch'" in result.stderr
