"""One acceptance formula for the offline eval, vLLM's counters and SGLang's verify counts."""

from __future__ import annotations

import random

from eagleops.pipeline.training.eval.acceptance import acceptance_from_counts, acceptance_from_steps


def test_acceptance_of_counted_steps():
    result = acceptance_from_steps([0, 2, 4, 4], draft_tokens=4)
    assert result.verify_steps == 4
    assert result.length == 3.5  # (1 + 3 + 5 + 5) tokens over 4 target forwards
    assert result.rate_per_position == [0.75, 1.0, 0.6667, 1.0]  # P(j accepted | j - 1 accepted)
    assert acceptance_from_steps([], draft_tokens=3) == acceptance_from_counts(0, 0, [0, 0, 0])
    assert acceptance_from_steps([], draft_tokens=3).length == 0.0


def test_counters_give_what_counting_the_steps_gives():
    """vLLM's totals (drafts, accepted tokens, drafts accepted at each position) are sums of the
    same steps the offline eval counts: the figures agree."""
    steps = [3, 0, 1, 4, 4, 2, 0, 4]
    counted = acceptance_from_steps(steps, draft_tokens=4)
    totals = acceptance_from_counts(float(len(steps)), float(sum(steps)), [float(sum(a > j for a in steps)) for j in range(4)])
    assert totals == counted


def test_sglang_tokens_per_verify_step():
    result = acceptance_from_counts(8, 24 - 8)  # 24 tokens generated in 8 verify steps
    assert (result.verify_steps, result.length, result.rate_per_position) == (8, 3.0, [])


def test_the_same_figures_as_the_formulas_it_replaced():
    def offline_before(steps: list[int], k: int) -> tuple[float, list[float]]:
        reached = [sum(1 for a in steps if a >= j) for j in range(k + 1)]
        length = round(sum(a + 1 for a in steps) / len(steps), 4) if steps else 0.0
        return length, [round(reached[j + 1] / reached[j], 4) if reached[j] else 0.0 for j in range(k)]

    def vllm_rates_before(drafts: float, per_position: list[float]) -> list[float]:
        reached = [drafts, *per_position]
        return [round(reached[j + 1] / reached[j], 4) if reached[j] else 0.0 for j in range(len(per_position))]

    rng = random.Random(7)
    for _ in range(2000):
        k = rng.randint(1, 8)
        steps = [rng.randint(0, k) for _ in range(rng.randint(0, 300))]
        result = acceptance_from_steps(steps, k)
        assert (result.length, result.rate_per_position) == offline_before(steps, k)
        per_position = [float(sum(a > j for a in steps)) for j in range(k)]
        assert acceptance_from_counts(float(len(steps)), float(sum(steps)), per_position).rate_per_position == vllm_rates_before(
            float(len(steps)), per_position
        )
