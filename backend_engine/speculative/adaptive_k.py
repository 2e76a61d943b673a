"""How many drafts a sequence proposes next step: a pure policy over its recent acceptance.

Drafts are not free: each one is a token the target scores in the step, and a sequence whose
drafts are mostly rejected pays for them and gains nothing. How much a step gains depends on
the sequence (a rewrite of its prompt copies long runs, an open chat almost none) and on the
phase it is in, so each sequence keeps its own estimate:

- **Acceptance per draft.** A step's drafts are accepted up to the first one the target
  rejects, so a step that proposed k and kept j saw j acceptances and, if j < k, one
  rejection; the drafts after a rejection say nothing. The estimate of the chance ``a`` that a
  draft is accepted, given the ones before it were, is accepted over (accepted + rejections):
  the maximum-likelihood estimate of a geometric run, censored at k. Both counts are moving
  averages over the steps that proposed something (``ema_weight`` on the newest), so the
  estimate follows the sequence's phase. (Accepted over proposed would read a long draft that
  ran true for 4 of 8 tokens as a = 0.5 and shrink k exactly where copying pays.) A step where
  the proposer found nothing (no n-gram match) or was not asked (k = 0, a large batch) says
  nothing about acceptance and leaves it as it was.
- **The k that pays best.** Scoring a draft is one more row in the step, nearly free where a
  step is bound by reading the weights (float32 on this CPU: a row ~5% of a one-token step)
  and not where each row is real compute (a quantized model's integer kernels here: ~70%).
  With ``draft_cost`` c (a draft row's cost over a one-token step's, measured by the
  runner at start), k drafts yield ``1 + a + ... + a^k`` tokens for a step costing ``1 + c k``:
  a sequence proposes the k up to ``max_k`` that maximizes that ratio, and none while no k
  beats a plain step's 1 (Leviathan et al.'s analysis, with a i.i.d.). k follows the estimate
  at once: a copy that starts pays from its next step.
- **Probing**: a sequence proposing nothing would never learn that its text turned copyable,
  so after ``probe_interval`` steps with no drafts it proposes one. An accepted probe raises
  the estimate; enough of them turn speculation back on.
- **The crossover**: a step is bound by reading the weights only while its batch is small;
  past ``crossover_batch_size`` sequences it is bound by compute, scoring drafts costs as
  much as it saves, and every sequence proposes nothing, whatever its state.

Measured on SmolLM2 float32 (greedy answers replayed through this policy and the n-gram
proposer, then timed in the engine: ``bench/speculative.py``): on copy-heavy prompts this
estimate keeps 2.5 tokens a step where accepted-over-proposed with k moving one step at a
time kept 2.1.

A settings object (frozen, validated once) and a state value (frozen, one per sequence) go
in; a k or the next state comes out. Nothing here knows about requests or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AdaptiveKSettings:
    max_k: int  # the most drafts a sequence proposes in a step
    crossover_batch_size: int  # a step with at least this many sequences proposes nothing
    draft_cost: float = 0.0  # a draft row's cost over a one-token step's (0: free)
    initial_acceptance: float = 0.7  # the estimate before a sequence's first verified draft
    prior_weight: float = 3.0  # the initial estimate counts as this many drafts' evidence
    ema_weight: float = 0.25  # the newest step's weight in the moving averages
    probe_interval: int = 16  # steps without drafts before one probing draft
    fixed_k: bool = False  # always propose max_k (below the crossover): no adaptation

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {self.max_k}")
        if self.crossover_batch_size < 1:
            raise ValueError(
                f"crossover_batch_size must be at least 1, got {self.crossover_batch_size}"
            )
        if not self.draft_cost >= 0.0:
            raise ValueError(f"draft_cost must be 0 or more, got {self.draft_cost}")
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance}")
        if not self.prior_weight > 0.0:
            raise ValueError(f"prior_weight must be positive, got {self.prior_weight}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be at least 1, got {self.probe_interval}")


@dataclass(frozen=True)
class AdaptiveKState:
    """One sequence's speculation state, replaced (never changed) after each step: moving
    averages of accepted drafts and of trials (accepted drafts plus rejections) per step."""

    accepted: float
    trials: float
    num_steps_off: int = 0  # steps without drafts since the last that had some

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft is accepted, given the ones before it were."""
        return self.accepted / self.trials if self.trials > 0.0 else 0.0


def initial_state(settings: AdaptiveKSettings) -> AdaptiveKState:
    weight = settings.prior_weight
    return AdaptiveKState(accepted=settings.initial_acceptance * weight, trials=weight)


def choose_k(settings: AdaptiveKSettings, state: AdaptiveKState, batch_size: int) -> int:
    """How many drafts to propose this step, in a step of ``batch_size`` sequences."""
    if batch_size >= settings.crossover_batch_size:
        return 0
    if settings.fixed_k:
        return settings.max_k
    k = paying_k(state.acceptance, settings.draft_cost, settings.max_k)
    if k == 0:
        return 1 if state.num_steps_off >= settings.probe_interval else 0
    return k


def paying_k(acceptance: float, draft_cost: float, max_k: int) -> int:
    """The k in 1..max_k with the most expected tokens per unit of step cost, or 0 if none
    beats a plain step (one token for a cost of one)."""
    best_k, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= acceptance
        expected += term
        rate = expected / (1.0 + draft_cost * k)
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
    trials = num_accepted + (1 if num_accepted < num_proposed else 0)
    keep = 1.0 - settings.ema_weight
    return AdaptiveKState(
        accepted=keep * state.accepted + settings.ema_weight * num_accepted,
        trials=keep * state.trials + settings.ema_weight * trials,
    )
