"""One step of a plan: the figure it computes, and its formula with the numbers that went in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanStep:
    key: str  # the CapacityPlan field it computes
    label: str
    formula: str  # with the numbers that went in
