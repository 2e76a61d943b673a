"""How many drafts a sequence proposes next step: a pure policy over its recent acceptance.

Drafts are not free: each one is a token the target scores in the step, and a sequence whose
drafts are mostly rejected pays for them and gains nothing. How much a step gains depends on
the sequence (a rewrite of its prompt copies long runs, an open chat almost none) and on the
phase it is in, so each sequence keeps its own estimate and its own k:

- **Acceptance** is an exponential moving average of accepted / proposed over the steps that
  proposed something (``ema_weight`` on the newest step). A step where the proposer found
  nothing (no n-gram match) or was not asked (k = 0, a large batch) says nothing about
  acceptance and leaves it as it was.
- **k moves one at a time**: up (to ``max_k``) while the average is at least ``grow_above``,
  down (to 0) while it is below ``shrink_below``, unchanged between them. Accepted / proposed
  falls as k grows (the later drafts of a run are the ones rejected), so k settles where the
  last drafts still pay, without a model of the acceptance curve.
- **Probing**: at k = 0 a sequence would never learn that its text turned copyable, so after
  ``probe_interval`` steps at 0 it proposes one draft. If the average is then no longer below
  ``shrink_below``, it speculates again at k = 1; if not, it waits another interval.
- **The crossover**: a step is bound by reading the weights only while its batch is small;
  past ``crossover_batch_size`` sequences it is bound by compute, scoring drafts costs as
  much as it saves, and every sequence proposes nothing, whatever its state.

- **The cost of a draft**: scoring a draft is one more row in the step, nearly free where a
  step is bound by reading the weights (float32 on this CPU: a row ~5% of a one-token step)
  and not where each row is real compute (a quantized model's integer kernels here: ~70%).
  With ``draft_row_cost`` c (a draft row's cost over a one-token step's, measured by the
  runner at start), k drafts at acceptance a yield ``1 + a + ... + a^k`` tokens for a step
  costing ``1 + c k``: a sequence proposes the k (up to its own) that maximizes that ratio,
  and none while no k beats a plain step's 1 (Leviathan et al.'s analysis, with a i.i.d.).
  Such a sequence probes like one at k = 0, so a rising acceptance turns it back on.

A settings object (frozen, validated once) and a state value (frozen, one per sequence) go
in; a k or the next state comes out. Nothing here knows about requests or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AdaptiveKSettings:
    max_k: int  # the most drafts a sequence proposes in a step
    crossover_batch_size: int  # a step with at least this many sequences proposes nothing
    initial_k: int = 1
    initial_acceptance: float = 0.5  # between the thresholds: k starts where it is set
    ema_weight: float = 0.25  # the newest step's weight in the average
    grow_above: float = 0.7
    shrink_below: float = 0.3
    probe_interval: int = 16  # steps at k = 0 before one probing draft
    draft_row_cost: float = 0.0  # a draft row's cost over a one-token step's (0: free)

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {self.max_k}")
        if self.crossover_batch_size < 1:
            raise ValueError(
                f"crossover_batch_size must be at least 1, got {self.crossover_batch_size}"
            )
        if not 0 <= self.initial_k <= self.max_k:
            raise ValueError(
                f"initial_k must be between 0 and max_k ({self.max_k}), got {self.initial_k}"
            )
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if not 0.0 <= self.shrink_below <= self.grow_above <= 1.0:
            raise ValueError(
                "the thresholds must satisfy 0 <= shrink_below <= grow_above <= 1, got "
                f"shrink_below={self.shrink_below}, grow_above={self.grow_above}"
            )
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance}")
        if not self.draft_row_cost >= 0.0:
            raise ValueError(f"draft_row_cost must be 0 or more, got {self.draft_row_cost}")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be at least 1, got {self.probe_interval}")


@dataclass(frozen=True)
class AdaptiveKState:
    """One sequence's speculation state, replaced (never changed) after each step."""

    k: int  # drafts to propose while the batch is below the crossover; 0: off, probing
    acceptance: float  # moving average of accepted / proposed
    num_steps_off: int = 0  # steps at k = 0 since the last probe (or since k reached 0)


def initial_state(settings: AdaptiveKSettings) -> AdaptiveKState:
    return AdaptiveKState(k=settings.initial_k, acceptance=settings.initial_acceptance)


def choose_k(settings: AdaptiveKSettings, state: AdaptiveKState, batch_size: int) -> int:
    """How many drafts to propose this step, in a step of ``batch_size`` sequences."""
    if batch_size >= settings.crossover_batch_size:
        return 0
    k = paying_k(state.acceptance, settings.draft_row_cost, state.k) if state.k else 0
    if k == 0:
        return 1 if state.num_steps_off >= settings.probe_interval else 0
    return k


def paying_k(acceptance: float, draft_row_cost: float, max_k: int) -> int:
    """The k in 1..max_k with the most expected tokens per unit of step cost, or 0 if none
    beats a plain step (one token for a cost of one)."""
    best_k, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= acceptance
        expected += term
        rate = expected / (1.0 + draft_row_cost * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def record_step(
    settings: AdaptiveKSettings, state: AdaptiveKState, num_proposed: int, num_accepted: int
) -> AdaptiveKState:
    """The state after a step that proposed ``num_proposed`` drafts (0 if none, for whatever
    reason) and kept ``num_accepted`` of them."""
    if not 0 <= num_accepted <= num_proposed:
        raise ValueError(
            f"a step keeps between 0 and its {num_proposed} drafts, not {num_accepted}"
        )
    if num_proposed == 0:  # no evidence either way; a sequence proposing nothing may probe
        return replace(state, num_steps_off=state.num_steps_off + 1)
    weight = settings.ema_weight
    acceptance = (1.0 - weight) * state.acceptance + weight * (num_accepted / num_proposed)
    if state.k == 0:  # a probe
        k = 1 if acceptance >= settings.shrink_below else 0
    elif acceptance >= settings.grow_above:
        k = min(state.k + 1, settings.max_k)
    elif acceptance < settings.shrink_below:
        k = state.k - 1
    else:
        k = state.k
    return AdaptiveKState(k=k, acceptance=acceptance, num_steps_off=0)
