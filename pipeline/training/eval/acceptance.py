"""Acceptance, one formula for every backend.

A verify step is one target forward over a chain of k drafts: it gains the drafts accepted plus
the target's own next token. Acceptance length = tokens gained per verify step, averaged over
the eval; the rate at position j = P(draft j accepted | drafts 1..j-1 accepted). The offline
eval counts each step itself; vLLM's counters give the same sums (drafts, accepted tokens, and
how many drafts had position j accepted); SGLang gives only tokens per verify step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Acceptance", "acceptance_from_counts", "acceptance_from_steps"]


@dataclass(frozen=True)
class Acceptance:
    verify_steps: int
    length: float  # tokens gained per verify step, rounded to 4 places
    rate_per_position: list[float]  # empty where the backend does not count by position


def acceptance_from_counts(verify_steps: float, accepted_tokens: float, accepted_at: Sequence[float] = ()) -> Acceptance:
    """From totals over the eval: verify steps, drafts accepted, and per draft position j
    (0-based) the verify steps that accepted it."""
    reached = [verify_steps, *accepted_at]  # steps whose first j drafts were all accepted
    return Acceptance(
        verify_steps=int(verify_steps),
        length=round((verify_steps + accepted_tokens) / verify_steps, 4) if verify_steps else 0.0,
        rate_per_position=[round(reached[j + 1] / reached[j], 4) if reached[j] else 0.0 for j in range(len(accepted_at))],
    )


def acceptance_from_steps(accepted_per_step: Sequence[int], draft_tokens: int) -> Acceptance:
    """From the number of drafts each verify step accepted (each at most ``draft_tokens``)."""
    accepted_at = [sum(1 for a in accepted_per_step if a > j) for j in range(draft_tokens)]
    return acceptance_from_counts(len(accepted_per_step), sum(accepted_per_step), accepted_at)
