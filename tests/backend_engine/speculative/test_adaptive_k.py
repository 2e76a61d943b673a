from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from backend_engine.speculative.adaptive_k import (
    AdaptiveKSettings,
    AdaptiveKState,
    choose_k,
    initial_state,
    paying_k,
    record_step,
)

SETTINGS = AdaptiveKSettings(
    max_k=4,
    crossover_batch_size=8,
    initial_k=2,
    initial_acceptance=0.5,
    ema_weight=0.5,
    grow_above=0.7,
    shrink_below=0.3,
    probe_interval=3,
)


def test_starts_at_the_initial_k_and_acceptance() -> None:
    assert initial_state(SETTINGS) == AdaptiveKState(k=2, acceptance=0.5, num_steps_off=0)
    assert choose_k(SETTINGS, initial_state(SETTINGS), batch_size=1) == 2


def test_proposes_nothing_at_or_above_the_crossover_batch_size() -> None:
    state = AdaptiveKState(k=4, acceptance=1.0)
    assert choose_k(SETTINGS, state, batch_size=7) == 4
    assert choose_k(SETTINGS, state, batch_size=8) == 0
    assert choose_k(SETTINGS, state, batch_size=32) == 0
    probing = AdaptiveKState(k=0, acceptance=0.0, num_steps_off=99)
    assert choose_k(SETTINGS, probing, batch_size=8) == 0


def test_k_grows_while_drafts_are_accepted_up_to_max_k() -> None:
    state = initial_state(SETTINGS)
    ks = []
    for _ in range(5):
        k = choose_k(SETTINGS, state, batch_size=1)
        state = record_step(SETTINGS, state, num_proposed=k, num_accepted=k)
        ks.append(state.k)
    # acceptance 0.75, 0.875, ...: at least grow_above from the first step
    assert ks == [3, 4, 4, 4, 4]


def test_k_shrinks_to_zero_while_drafts_are_rejected() -> None:
    state = AdaptiveKState(k=3, acceptance=0.5)
    ks = []
    for _ in range(5):
        k = choose_k(SETTINGS, state, batch_size=1)
        state = record_step(SETTINGS, state, num_proposed=k, num_accepted=0)
        ks.append(state.k)
    # acceptance 0.25 (< 0.3) from the first step; k = 0 then proposes nothing
    assert ks == [2, 1, 0, 0, 0]
    assert choose_k(SETTINGS, AdaptiveKState(k=0, acceptance=0.0), batch_size=1) == 0


def test_k_holds_between_the_thresholds() -> None:
    state = AdaptiveKState(k=2, acceptance=0.5)
    after = record_step(SETTINGS, state, num_proposed=2, num_accepted=1)
    assert after == AdaptiveKState(k=2, acceptance=0.5)


def test_acceptance_is_a_moving_average_of_accepted_over_proposed() -> None:
    state = AdaptiveKState(k=4, acceptance=0.5)
    after = record_step(SETTINGS, state, num_proposed=4, num_accepted=1)
    assert after.acceptance == pytest.approx(0.5 * 0.5 + 0.5 * 0.25)


def test_a_step_without_proposals_only_counts_a_step_off() -> None:
    # No n-gram match, or a batch past the crossover: no evidence either way.
    state = AdaptiveKState(k=3, acceptance=0.6)
    after = record_step(SETTINGS, state, num_proposed=0, num_accepted=0)
    assert after == replace(state, num_steps_off=1)


def test_free_drafts_always_pay_and_costly_ones_only_at_high_acceptance() -> None:
    assert paying_k(0.1, 0.0, 4) == 4  # any acceptance: more drafts, more tokens, same cost
    # A draft row costing 70% of a step (a quantized model's integer kernels on this CPU):
    # one draft yields 1 + a tokens for 1.7, so it pays only from a > 0.7.
    assert paying_k(0.5, 0.7, 4) == 0
    assert paying_k(0.8, 0.7, 4) == 1
    assert paying_k(0.98, 0.7, 4) == 4
    # Float32 here (a row ~5%): 3 drafts at a = 0.5 (1.875 / 1.15 beats 1.75 / 1.1).
    assert paying_k(0.5, 0.05, 4) == 3


def test_a_sequence_whose_drafts_do_not_pay_probes_like_one_at_zero() -> None:
    costly = replace(SETTINGS, draft_row_cost=0.7)
    state = AdaptiveKState(k=3, acceptance=0.5)
    assert choose_k(costly, state, batch_size=1) == 0
    state = record_step(costly, state, num_proposed=0, num_accepted=0)
    state = record_step(costly, state, num_proposed=0, num_accepted=0)
    assert choose_k(costly, state, batch_size=1) == 0
    state = record_step(costly, state, num_proposed=0, num_accepted=0)
    assert choose_k(costly, state, batch_size=1) == 1  # the probe
    state = record_step(costly, state, num_proposed=1, num_accepted=1)
    assert state.acceptance == pytest.approx(0.75)
    assert choose_k(costly, state, batch_size=1) == 1  # 1.75 / 1.7 > 1


def test_a_sequence_at_zero_probes_after_the_interval() -> None:
    state = AdaptiveKState(k=0, acceptance=0.1)
    proposed = []
    for _ in range(4):
        k = choose_k(SETTINGS, state, batch_size=1)
        proposed.append(k)
        if k == 0:
            state = record_step(SETTINGS, state, num_proposed=0, num_accepted=0)
    assert proposed == [0, 0, 0, 1]
    assert state.num_steps_off == 3


def test_a_successful_probe_turns_speculation_back_on() -> None:
    state = AdaptiveKState(k=0, acceptance=0.1, num_steps_off=3)
    after = record_step(SETTINGS, state, num_proposed=1, num_accepted=1)
    assert (after.k, after.acceptance, after.num_steps_off) == (1, pytest.approx(0.55), 0)


def test_a_failed_probe_waits_another_interval() -> None:
    state = AdaptiveKState(k=0, acceptance=0.1, num_steps_off=3)
    after = record_step(SETTINGS, state, num_proposed=1, num_accepted=0)
    assert (after.k, after.acceptance, after.num_steps_off) == (0, pytest.approx(0.05), 0)
    assert choose_k(SETTINGS, after, batch_size=1) == 0


def test_one_good_probe_may_not_be_enough_after_a_long_bad_run() -> None:
    settings = AdaptiveKSettings(max_k=4, crossover_batch_size=8, ema_weight=0.25)
    state = AdaptiveKState(k=0, acceptance=0.0, num_steps_off=16)
    state = record_step(settings, state, num_proposed=1, num_accepted=1)
    assert (state.k, state.acceptance) == (0, 0.25)
    state = replace(state, num_steps_off=16)
    state = record_step(settings, state, num_proposed=1, num_accepted=1)
    assert (state.k, state.acceptance) == (1, pytest.approx(0.4375))


def test_rejects_more_accepted_than_proposed() -> None:
    with pytest.raises(ValueError, match="between 0 and its 2 drafts, not 3"):
        record_step(SETTINGS, initial_state(SETTINGS), num_proposed=2, num_accepted=3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_k": 0}, "max_k must be at least 1"),
        ({"crossover_batch_size": 0}, "crossover_batch_size must be at least 1"),
        ({"initial_k": 5}, r"initial_k must be between 0 and max_k \(4\)"),
        ({"ema_weight": 0.0}, r"ema_weight must be in \(0, 1\]"),
        ({"shrink_below": 0.8}, "shrink_below <= grow_above"),
        ({"grow_above": 1.5}, "shrink_below <= grow_above <= 1"),
        ({"initial_acceptance": -0.1}, r"initial_acceptance must be in \[0, 1\]"),
        ({"probe_interval": 0}, "probe_interval must be at least 1"),
    ],
)
def test_settings_are_validated(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"max_k": 4, "crossover_batch_size": 8, **changes}
    with pytest.raises(ValueError, match=message):
        AdaptiveKSettings(**fields)
