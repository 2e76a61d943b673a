from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from backend_engine import AsyncEngine, EngineConfig, Priority, SamplingParams
from backend_engine.async_engine import EngineError
from backend_engine.core.kv_event_log import KVCacheEvent
from backend_engine.core.step_runner import PlanRunner
from tests.support.stand_in_runner import plan_stand_in_runner


@pytest.fixture
async def engine(demo_checkpoint):
    eng = AsyncEngine(EngineConfig(model=str(demo_checkpoint(size="tiny")), dtype="float32"))
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(engine, rid, prompt, params, **kw):
    deltas = [d async for d in engine.generate(rid, prompt, params, **kw)]
    return deltas


async def test_streamed_deltas_add_up_to_the_offline_result(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = await collect(engine, "r1", "Hello world", params)
    assert deltas[-1].finished
    assert deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert len(tokens) == 12
    assert "".join(d.new_text for d in deltas) == engine.tokenizer.decode(tokens)
    assert deltas[-1].num_completion_tokens == 12
    assert deltas[-1].num_prompt_tokens == len(engine.tokenizer.encode("Hello world"))


async def test_concurrent_requests_with_tenants_and_priorities(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = await asyncio.gather(
        *[
            collect(
                engine,
                f"c{i}",
                f"prompt number {i}",
                params,
                tenant_id=f"tenant-{i % 3}",
                priority=Priority(i % 2),
            )
            for i in range(10)
        ]
    )
    assert all(r[-1].num_completion_tokens == 8 for r in results)
    assert engine.stats().num_running == 0


async def test_closing_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    stream = engine.generate("long", "A long generation", params)
    async for delta in stream:
        if delta.num_completion_tokens >= 3:
            break
    await stream.aclose()
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    stats = engine.stats()
    assert stats.num_running == 0
    assert stats.num_waiting == 0
    assert stats.num_kv_blocks_used == 0


async def test_explicit_abort_ends_the_stream(engine):
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    seen = []

    async def consume():
        async for delta in engine.generate("victim", "Abort me", params):
            seen.append(delta)

    task = asyncio.create_task(consume())
    while not seen:  # noqa: ASYNC110 (the engine's deltas)
        await asyncio.sleep(0.01)
    await engine.abort("victim")
    await asyncio.wait_for(task, timeout=10)
    assert seen[-1].finished
    assert seen[-1].finish_reason == "abort"


async def test_invalid_request_raises_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        await collect(engine, "bad", "x", SamplingParams(max_tokens=10**7))
    assert engine.stats().num_waiting == 0


async def test_duplicate_request_id_is_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    first = engine.generate("dup", "one", params)
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine, "dup", "two", params)
    await first.aclose()


def victim_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_k=30, seed=7 + i, max_tokens=16, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


async def test_poisoned_requests_fail_alone_among_twelve_streams_of_another_tenant(engine):
    """The issue's case: one poisoned request used to abort every stream in flight."""
    prompts = [f"Tenant alice, question number {i}" for i in range(12)]
    alone = []
    for i, prompt in enumerate(prompts):
        deltas = await collect(engine, f"alone-{i}", prompt, victim_params(i))
        alone.append([t for d in deltas for t in d.new_token_ids])
    events: list[str] = []

    async def victim(i: int) -> list[int]:
        deltas = await collect(
            engine, f"alice-{i}", prompts[i], victim_params(i), tenant_id="alice"
        )
        events.append("alice finished")
        assert deltas[-1].finish_reason == "length"
        return [t for d in deltas for t in d.new_token_ids]

    async def attacker(field: str, value: int) -> None:
        poison = SamplingParams(temperature=1.0, max_tokens=16)
        object.__setattr__(poison, field, value)  # past any validation
        with pytest.raises(EngineError, match="Overflow"):
            await collect(engine, f"mallory-{field}", "Hello", poison, tenant_id="mallory")
        events.append("mallory failed")

    results = await asyncio.gather(
        attacker("seed", 2**64), *(victim(i) for i in range(12)), attacker("top_k", 10**20)
    )
    assert events[:2] == ["mallory failed"] * 2  # while the twelve were still streaming
    assert results[1:-1] == alone
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0


async def test_the_engine_is_built_and_stepped_on_one_thread_not_the_callers(
    demo_checkpoint, monkeypatch
):
    """A second thread running tensor work would slow every step (module docstring)."""
    from backend_engine import async_engine

    threads: dict[str, set[int]] = {"built": set(), "stepped": set()}

    class RecordingEngine(async_engine.LLMEngine):
        def __init__(
            self,
            config: EngineConfig,
            plan_runner: PlanRunner | None,
            kv_events: list[KVCacheEvent] | None = None,
        ) -> None:
            threads["built"].add(threading.get_ident())
            super().__init__(config, plan_runner, kv_events)

        def step(self):  # type: ignore[no-untyped-def]
            threads["stepped"].add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", RecordingEngine)
    eng = AsyncEngine(EngineConfig(model=str(demo_checkpoint(size="tiny")), dtype="float32"))
    await eng.start()
    try:
        await collect(eng, "r", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        await eng.shutdown()
    assert len(threads["built"]) == 1
    assert threads["built"] == threads["stepped"]
    assert threading.get_ident() not in threads["built"]
    with pytest.raises(RuntimeError, match="shut down"):
        await eng.start()


def test_a_process_that_never_shuts_the_engine_down_still_exits(demo_checkpoint, tmp_path):
    script = tmp_path / "forgets_shutdown.py"
    script.write_text(
        "import asyncio, sys\n"
        "from backend_engine import AsyncEngine, EngineConfig, SamplingParams\n"
        "async def main():\n"
        "    engine = AsyncEngine(EngineConfig(model=sys.argv[1], show_progress=False))\n"
        "    await engine.start()\n"
        "    async for _ in engine.generate('r', 'Hi', SamplingParams(max_tokens=2)):\n"
        "        pass\n"
        "asyncio.run(main())\n"
    )
    model = str(demo_checkpoint(size="tiny"))
    done = subprocess.run([sys.executable, str(script), model], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


async def test_a_step_that_fails_as_a_whole_leaves_no_unwritten_blocks_in_the_prefix_cache(
    engine, monkeypatch
):
    # A step that raises before its forward pass has written anything fails every request in
    # flight; the blocks they were allocated (offered to the prefix cache then) hold no KV,
    # so a later request with the same prompt must not reuse them.
    prompt = "The same long system prompt, shared by every request of this tenant. " * 3
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = await collect(engine, "reference", prompt, params)
    llm = engine.engine
    llm.kv_cache.pool.reset_prefix_cache()  # the engine is idle between requests
    for keys, values in llm.runner.kv_caches:  # no stale copy of the right KV anywhere
        keys.zero_()
        values.zero_()

    def fail(output):
        raise RuntimeError("the whole step failed")

    with monkeypatch.context() as patch:
        patch.setattr(llm.runner, "execute", fail)
        with pytest.raises(EngineError):
            await collect(engine, "first", prompt, params)
    again = await collect(engine, "second", prompt, params)
    tokens = [t for d in again for t in d.new_token_ids]
    assert tokens == [t for d in reference for t in d.new_token_ids]
    assert again[-1].num_cached_tokens == 0  # nothing of the failed step was reused


async def test_stats_read_a_snapshot_the_engine_thread_published(engine, monkeypatch):
    """stats() never reads the engine's live state: every EngineStats is built on the engine
    thread, after a step, and each one a reader gets is internally consistent."""
    llm = engine.engine
    built_on: list[str] = []
    live_stats = llm.stats

    def recording_stats():
        built_on.append(threading.current_thread().name)
        return live_stats()

    monkeypatch.setattr(llm, "stats", recording_stats)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    num_requests = 6
    readings = []
    generation = asyncio.gather(
        *[collect(engine, f"s{i}", f"snapshot prompt {i}", params) for i in range(num_requests)]
    )
    while not generation.done():
        readings.append(engine.stats())
        await asyncio.sleep(0)  # let the stream tasks run; the engine thread steps meanwhile
    await generation
    readings.append(engine.stats())
    assert built_on
    assert set(built_on) == {"tollway-engine"}
    for stats in readings:
        assert stats.num_running + stats.num_waiting <= num_requests
        assert 0 <= stats.num_kv_blocks_used <= stats.num_kv_blocks_total
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert stats.num_generation_tokens <= num_requests * 16
    final = readings[-1]
    assert final.num_running == final.num_waiting == final.num_kv_blocks_used == 0
    assert final.num_generation_tokens >= num_requests * 16
    assert engine.stats() is engine.stats()  # one published object, not rebuilt per read


async def wait_until_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


async def test_n_choices_come_on_one_stream_with_their_index(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    deltas = await collect(engine, "group", "Three answers please", params)
    assert {d.request_id for d in deltas} == {"group"}
    finished = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finished) == [0, 1, 2]
    assert deltas[-1].finished  # the stream ends with the last choice's end
    tokens = {i: [t for d in deltas if d.index == i for t in d.new_token_ids] for i in range(3)}
    assert tokens[0] == tokens[1] == tokens[2]
    assert len(tokens[0]) == 6
    single = await collect(engine, "one", "Three answers please", replace(params, n=1))
    assert [t for d in single for t in d.new_token_ids] == tokens[0]


async def test_closing_an_n_stream_early_aborts_every_choice(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=2000, ignore_eos=True, n=4)
    stream = engine.generate("long-group", "A long generation", params)
    seen = set()
    async for delta in stream:
        seen.add(delta.index)
        if len(seen) == 4:
            break
    await stream.aclose()
    await wait_until_idle(engine)


async def test_abort_by_the_callers_id_ends_every_choice(engine):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=2000, ignore_eos=True, n=3)
    seen = []

    async def consume():
        async for delta in engine.generate("victims", "Abort us", params):
            seen.append(delta)

    task = asyncio.create_task(consume())
    while len({d.index for d in seen}) < 3:  # noqa: ASYNC110 (the engine's deltas)
        await asyncio.sleep(0.01)
    await engine.abort("victims")
    await asyncio.wait_for(task, timeout=10)
    ends = [d for d in seen if d.finished]
    assert sorted(d.index for d in ends) == [0, 1, 2]
    assert {d.finish_reason for d in ends} == {"abort"}
    await wait_until_idle(engine)


async def test_a_choice_that_fails_fails_the_request_and_the_others_are_aborted(
    engine, monkeypatch
):
    make_request = engine.engine.make_request

    def poisoned_choice_1(*args, **kwargs):
        leader = make_request(*args, **kwargs)
        child = leader.pending_forks[0]
        child.sampling_params = replace(child.sampling_params)
        object.__setattr__(child.sampling_params, "top_k", 10**20)  # fails when sampled
        return leader

    monkeypatch.setattr(engine.engine, "make_request", poisoned_choice_1)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=2000, ignore_eos=True, n=3)
    with pytest.raises(EngineError, match="failed to run this request"):
        await collect(engine, "poisoned-group", "Fail one of us", params)
    await wait_until_idle(engine)


async def test_a_choice_id_of_another_request_is_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2)
    first = engine.generate("pair", "one", params)
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine, "pair#1", "two", replace(params, n=1))
    await first.aclose()
    await wait_until_idle(engine)


async def test_the_stand_in_runner_forks_choices_too(demo_model_files):
    engine = AsyncEngine(
        EngineConfig(model=str(demo_model_files())), plan_runner=plan_stand_in_runner()
    )
    await engine.start()
    try:
        params = SamplingParams(max_tokens=5, n=3)
        deltas = await collect(engine, "stand-in", "Hello there", params)
        ends = sorted((d.index, d.num_completion_tokens) for d in deltas if d.finished)
        assert ends == [(0, 5), (1, 5), (2, 5)]
        assert engine.stats().num_computed_prompt_tokens == deltas[-1].num_prompt_tokens
    finally:
        await engine.shutdown()
