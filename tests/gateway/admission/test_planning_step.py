"""The planning step without a server: the policies in order, on counted prompts, with the
rollout table and the pool load given; nothing is counted against the tenant."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.admission.outcomes import Refusal
from gateway.admission.planning_step import AdmissionPlan, PlanningStep
from gateway.admission.token_counter import TokenCounter, for_openai_model
from gateway.auth.bearer_keys import Caller
from gateway.completion_body import CompletionBody
from gateway.rollouts import LiveRollouts
from gateway.settings import GatewaySettings
from policies.model_routing import PoolLoad
from policies.quota import TenantQuota

MESSAGES = [{"role": "user", "content": "three word prompt"}]
COUNTER = for_openai_model("small")
PROMPT_TOKENS = COUNTER.count_chat(MESSAGES)


class RecordedLoad:
    """A `PoolLoadSource` that answers one load and records what it was asked."""

    def __init__(self, load: PoolLoad | None = None) -> None:
        self.value = load
        self.asked: list[str] = []

    async def load(self, model: str) -> PoolLoad | None:
        self.asked.append(model)
        return self.value


def settings() -> GatewaySettings:
    model = {"upstreams": ["http://127.0.0.1:1"], "context_window": 64}
    return GatewaySettings.from_dict(
        {
            "models": {"small": model, "large-v1": model},
            "rollouts": {"large": {"large-v1": 1}},
            "routing": {"aliases": {"auto": {"small": "small", "large": "large"}}},
        }
    )


def planner(load: RecordedLoad | None = None) -> PlanningStep:
    config = settings()
    counters: dict[str, TokenCounter] = {name: COUNTER for name in config.models}
    return PlanningStep(config, counters, LiveRollouts(config.rollouts), load or RecordedLoad())


def caller(**quota: Any) -> Caller:
    return Caller("key-1", "acme", TenantQuota(**quota), None)


def chat(model: str, max_tokens: int | None = 8, **raw: Any) -> CompletionBody:
    fields = {"model": model, "messages": MESSAGES, **raw}
    return CompletionBody("chat", fields, model, MESSAGES, None, max_tokens, False, False)


async def test_a_model_is_planned_with_its_counted_prompt() -> None:
    plan = await planner().plan(caller(), chat("small"), None)
    assert plan == AdmissionPlan("small", "small", None, PROMPT_TOKENS, 8, "interactive")
    assert plan.tokens == PROMPT_TOKENS + 8
    assert plan.prompt_token_ids is None  # an estimate has no engine ids


async def test_a_rollout_is_served_under_its_name_by_a_version() -> None:
    plan = await planner().plan(caller(), chat("large"), None)
    assert isinstance(plan, AdmissionPlan)
    assert (plan.served_model, plan.version) == ("large", "large-v1")


async def test_an_alias_is_routed_reading_the_large_versions_load() -> None:
    load = RecordedLoad(PoolLoad(num_waiting=0, kv_usage=0.0))
    plan = await planner(load).plan(caller(), chat("auto", tollway_hint="large"), None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.route is not None
    assert (plan.served_model, plan.version, plan.route.size) == ("large", "large-v1", "large")
    assert load.asked == ["large-v1"]


async def test_an_unknown_model_is_refused_before_anything_is_decided() -> None:
    refusal = await planner().plan(caller(), chat("nope"), None)
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.status == 404
    assert (refusal.served_model, refusal.version, refusal.prompt_tokens) == (None, None, 0)


@pytest.mark.parametrize(
    ("quota", "max_tokens", "status", "code"),
    [
        ({"max_prompt_tokens": 2}, 8, 400, "context_length_exceeded"),
        ({"max_output_tokens": 4}, 8, 400, "invalid_value"),
    ],
)
async def test_a_refusal_keeps_what_was_decided_before_it(
    quota: dict[str, Any], max_tokens: int, status: int, code: str
) -> None:
    refusal = await planner().plan(caller(**quota), chat("large", max_tokens), None)
    assert isinstance(refusal, Refusal)
    assert (refusal.rejection.status, refusal.rejection.code) == (status, code)
    assert (refusal.served_model, refusal.version) == ("large", "large-v1")
    assert refusal.prompt_tokens > 0


async def test_an_unknown_priority_is_refused() -> None:
    refusal = await planner().plan(caller(), chat("small"), "urgent-please")
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.status == 400


def completion(*prompts: str | list[int], n: int = 1, max_tokens: int | None = 8) -> CompletionBody:
    fields = {"model": "small", "prompt": list(prompts), "n": n}
    return CompletionBody(
        "completions", fields, "small", None, prompts, max_tokens, False, False, n
    )


async def test_n_choices_reserve_max_tokens_each_and_the_prompt_once() -> None:
    plan = await planner().plan(caller(), replace(chat("small"), n=4), None)
    assert isinstance(plan, AdmissionPlan)
    assert (plan.prompt_tokens, plan.num_choices) == (PROMPT_TOKENS, 4)
    assert plan.tokens == PROMPT_TOKENS + 4 * 8


async def test_a_prompt_list_reserves_every_prompt_and_n_choices_for_each() -> None:
    texts = ("one two", "three four five six", "seven")
    each = [COUNTER.count_prompt(t) for t in texts]
    plan = await planner().plan(caller(), completion(*texts, [1, 2, 3], n=3), None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.prompt_tokens == sum(each) + 3
    assert plan.num_choices == 3 * 4
    assert plan.tokens == sum(each) + 3 + 12 * 8


async def test_each_prompt_must_fit_the_longest_bounds_max_tokens() -> None:
    short, long = [1] * 10, [1] * 60  # the context window is 64
    plan = await planner().plan(caller(), completion(short, long, max_tokens=None), None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.max_tokens == 64 - 60  # the room the longest prompt leaves
    assert plan.tokens == 70 + 2 * 4
    refusal = await planner().plan(caller(max_prompt_tokens=40), completion(short, long), None)
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.code == "context_length_exceeded"
    assert "60 tokens" in refusal.rejection.message  # the longest, not the sum (70)
    too_long = await planner().plan(caller(), completion(short, [1] * 64), None)
    assert isinstance(too_long, Refusal)
    assert too_long.rejection.code == "context_length_exceeded"
    fits_alone = await planner().plan(caller(), completion(*[[1] * 40] * 3, max_tokens=20), None)
    assert isinstance(fits_alone, AdmissionPlan)  # 120 tokens in all: each prompt fits
    assert fits_alone.tokens == 120 + 3 * 20


async def test_without_max_tokens_an_answer_may_run_to_the_context_end_under_the_cap() -> None:
    plan = await planner().plan(caller(), chat("small", None), None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.max_tokens == 64 - PROMPT_TOKENS
    capped = await planner().plan(
        caller(max_output_tokens=10), replace(chat("small", None), n=2), None
    )
    assert isinstance(capped, AdmissionPlan)
    assert capped.max_tokens == 10
    assert capped.tokens == PROMPT_TOKENS + 2 * 10


def routing_settings(small_window: int, large_window: int) -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "models": {
                "small": {"upstreams": ["http://127.0.0.1:1"], "context_window": small_window},
                "large": {"upstreams": ["http://127.0.0.1:2"], "context_window": large_window},
            },
            "routing": {
                "aliases": {"auto": {"small": "small", "large": "large"}},
                "long_prompt_tokens": 4,
            },
        }
    )


def routing_planner(config: GatewaySettings) -> PlanningStep:
    counters: dict[str, TokenCounter] = {name: COUNTER for name in config.models}
    return PlanningStep(config, counters, LiveRollouts(config.rollouts), RecordedLoad())


async def test_a_long_prompt_goes_to_the_model_whose_context_holds_it() -> None:
    """The long-prompt rule picks large, whose window is too small: small's holds it."""
    long_messages = [{"role": "user", "content": "word " * 40}]
    body = CompletionBody(
        "chat",
        {"model": "auto", "messages": long_messages},
        "auto",
        long_messages,
        None,
        1,
        False,
        False,
    )
    prompt_tokens = COUNTER.count_chat(long_messages)
    plan = await routing_planner(routing_settings(10_000, prompt_tokens)).plan(caller(), body, None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.route is not None
    assert (plan.served_model, plan.route.reason) == ("small", "context_fallback")
    # Where the large window holds it, the rule's choice stands.
    plan = await routing_planner(routing_settings(10_000, 10_000)).plan(caller(), body, None)
    assert isinstance(plan, AdmissionPlan)
    assert plan.route is not None
    assert (plan.served_model, plan.route.reason) == ("large", "long_prompt")
    # Where neither holds it, the chosen model refuses it with the context-length error.
    refusal = await routing_planner(routing_settings(prompt_tokens, prompt_tokens)).plan(
        caller(), body, None
    )
    assert isinstance(refusal, Refusal)
    assert refusal.rejection.code == "context_length_exceeded"
