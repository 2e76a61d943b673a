"""The runner builds its batch from what the scheduler says each item is, not from their order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend_engine.config import EngineConfig
from backend_engine.core.step_runner import SampledToken
from backend_engine.llm_engine import LLMEngine
from backend_engine.sampling_params import SamplingParams


def test_decodes_and_prefills_are_told_apart_by_kind_not_by_position(
    demo_checkpoint: Callable[..., Path],
) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(demo_checkpoint(size="tiny")), dtype="float32", show_progress=False)
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("decoding", [5, 6, 7, 8, 9], greedy)
    engine.step()  # prefilled: next step it decodes
    engine.add_request("prefilling", list(range(10, 40)), greedy)
    output = engine.scheduler.schedule()
    assert [s.request_id for s in output.decodes] == ["decoding"]
    assert [s.request_id for s in output.prefills] == ["prefilling"]

    def tokens(outcomes: list[SampledToken | Exception | None]) -> list[int]:
        assert all(isinstance(o, SampledToken) for o in outcomes), outcomes
        return [o.token_id for o in outcomes if isinstance(o, SampledToken)]

    decodes_first = tokens(engine.runner._forward_and_sample(output.scheduled, {}))
    # The same items handed over prefill first: the runner still computes the decode as a
    # decode and the chunk as a prefill (rewriting the same KV at the same slots).
    prefill_first = tokens(engine.runner._forward_and_sample(output.scheduled[::-1], {}))
    assert prefill_first == decodes_first[::-1]
