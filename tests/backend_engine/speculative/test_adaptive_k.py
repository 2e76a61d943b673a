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

# Free drafts: any acceptance above 0 pays the whole max_k; costly ones are the other tests'.
SETTINGS = AdaptiveKSettings(
    max_k=4,
    crossover_batch_size=8,
    initial_acceptance=0.5,
    prior_weight=2.0,
    ema_weight=0.5,
    probe_interval=3,
)
COSTLY = replace(SETTINGS, draft_cost=0.7)  # a quantized model's integer kernels here


def test_starts_from_the_prior() -> None:
    state = initial_state(SETTINGS)
    assert state == AdaptiveKState(accepted=1.0, trials=2.0, num_steps_off=0)
    assert state.acceptance == 0.5
    assert choose_k(SETTINGS, state, batch_size=1) == 4


def test_proposes_nothing_at_or_above_the_crossover_batch_size() -> None:
    state = AdaptiveKState(accepted=1.0, trials=1.0)
    assert choose_k(SETTINGS, state, batch_size=7) == 4
    assert choose_k(SETTINGS, state, batch_size=8) == 0
    assert choose_k(SETTINGS, state, batch_size=32) == 0
    probing = AdaptiveKState(accepted=0.0, trials=1.0, num_steps_off=99)
    assert choose_k(SETTINGS, probing, batch_size=8) == 0


def test_a_rejection_counts_once_and_the_drafts_after_it_not_at_all() -> None:
    # 8 drafts, 4 kept: 4 acceptances and 1 rejection (the 5th); drafts 6-8 were never judged.
    state = AdaptiveKState(accepted=0.0, trials=0.0)
    after = record_step(replace(SETTINGS, ema_weight=1.0), state, num_proposed=8, num_accepted=4)
    assert (after.accepted, after.trials) == (4.0, 5.0)
    assert after.acceptance == pytest.approx(0.8)
    # All kept: 3 acceptances, no rejection seen.
    after = record_step(replace(SETTINGS, ema_weight=1.0), state, num_proposed=3, num_accepted=3)
    assert after.acceptance == 1.0


def test_counts_are_moving_averages_over_steps_that_proposed() -> None:
    state = AdaptiveKState(accepted=2.0, trials=4.0)
    after = record_step(SETTINGS, state, num_proposed=4, num_accepted=1)
    assert (after.accepted, after.trials) == (pytest.approx(1.5), pytest.approx(3.0))


def test_a_step_without_proposals_only_counts_a_step_off() -> None:
    # No n-gram match, or a batch past the crossover: no evidence either way.
    state = AdaptiveKState(accepted=3.0, trials=4.0)
    after = record_step(SETTINGS, state, num_proposed=0, num_accepted=0)
    assert after == replace(state, num_steps_off=1)


def test_k_follows_the_estimate_at_once() -> None:
    # Drafts at 70% of a step: at a = 0.8 one pays; three kept drafts in a row raise the
    # estimate to 0.92, where two pay (2.76 tokens for 2.4 beats 1.92 for 1.7).
    state = AdaptiveKState(accepted=4.0, trials=5.0)
    assert choose_k(COSTLY, state, batch_size=1) == 1
    state = record_step(COSTLY, state, num_proposed=1, num_accepted=1)  # 2.5 / 3.0
    state = record_step(COSTLY, state, num_proposed=1, num_accepted=1)  # 1.75 / 2.0
    state = record_step(COSTLY, state, num_proposed=1, num_accepted=1)
    assert state.acceptance == pytest.approx(1.375 / 1.5)
    assert choose_k(COSTLY, state, batch_size=1) == 2


def test_rejections_turn_costly_drafts_off() -> None:
    state = AdaptiveKState(accepted=4.0, trials=5.0)
    ks = []
    for _ in range(3):
        k = choose_k(COSTLY, state, batch_size=1)
        state = record_step(COSTLY, state, num_proposed=k, num_accepted=0)
        ks.append(k)
    assert ks == [1, 0, 0]  # 2 / 3: 1.67 / 1.7 no longer beats a plain step


def test_free_drafts_always_pay_and_costly_ones_only_at_high_acceptance() -> None:
    assert paying_k(0.1, 0.0, 4) == 4  # any acceptance: more drafts, more tokens, same cost
    # A draft row costing 70% of a step: one draft yields 1 + a tokens for 1.7, so it pays
    # only from a > 0.7.
    assert paying_k(0.5, 0.7, 4) == 0
    assert paying_k(0.8, 0.7, 4) == 1
    assert paying_k(0.98, 0.7, 4) == 4
    # Float32 here (a row ~5%): 3 drafts at a = 0.5 (1.875 / 1.15 beats 1.75 / 1.1).
    assert paying_k(0.5, 0.05, 4) == 3
    assert paying_k(0.0, 0.0, 4) == 0  # nothing accepted: a draft never pays


def test_a_sequence_whose_drafts_do_not_pay_probes_after_the_interval() -> None:
    state = AdaptiveKState(accepted=1.0, trials=2.0)  # a = 0.5: nothing pays at 0.7 a row
    proposed = []
    for _ in range(4):
        k = choose_k(COSTLY, state, batch_size=1)
        proposed.append(k)
        if k == 0:
            state = record_step(COSTLY, state, num_proposed=0, num_accepted=0)
    assert proposed == [0, 0, 0, 1]
    assert state.num_steps_off == 3


def test_a_successful_probe_raises_the_estimate_and_a_failed_one_waits_again() -> None:
    state = AdaptiveKState(accepted=2.0, trials=3.0, num_steps_off=3)  # a = 0.67: none pays
    assert choose_k(COSTLY, state, batch_size=1) == 1  # the probe
    accepted = record_step(COSTLY, state, num_proposed=1, num_accepted=1)
    assert (accepted.acceptance, accepted.num_steps_off) == (pytest.approx(0.75), 0)
    assert choose_k(COSTLY, accepted, batch_size=1) == 1  # 1.75 / 1.7 > 1
    rejected = record_step(COSTLY, state, num_proposed=1, num_accepted=0)
    assert (rejected.acceptance, rejected.num_steps_off) == (pytest.approx(0.5), 0)
    assert choose_k(COSTLY, rejected, batch_size=1) == 0


def test_fixed_k_always_proposes_max_k_below_the_crossover() -> None:
    fixed = replace(COSTLY, fixed_k=True)
    never_accepted = AdaptiveKState(accepted=0.0, trials=5.0)
    assert choose_k(fixed, never_accepted, batch_size=1) == 4
    assert choose_k(fixed, never_accepted, batch_size=8) == 0


def test_rejects_more_accepted_than_proposed() -> None:
    with pytest.raises(ValueError, match="between 0 and its 2 drafts, not 3"):
        record_step(SETTINGS, initial_state(SETTINGS), num_proposed=2, num_accepted=3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_k": 0}, "max_k must be at least 1"),
        ({"crossover_batch_size": 0}, "crossover_batch_size must be at least 1"),
        ({"draft_cost": -0.1}, "draft_cost must be 0 or more"),
        ({"initial_acceptance": -0.1}, r"initial_acceptance must be in \[0, 1\]"),
        ({"prior_weight": 0.0}, "prior_weight must be positive"),
        ({"ema_weight": 0.0}, r"ema_weight must be in \(0, 1\]"),
        ({"probe_interval": 0}, "probe_interval must be at least 1"),
    ],
)
def test_settings_are_validated(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"max_k": 4, "crossover_batch_size": 8, **changes}
    with pytest.raises(ValueError, match=message):
        AdaptiveKSettings(**fields)
