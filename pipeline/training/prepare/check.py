"""Whether a sample trains exactly what the target wrote: its answer and end of turn always, its
thinking under ``keep`` only, and nothing of the prompt or the template's own text. ``eagleops
inspect`` shows it; prepare runs it on the first samples of every dataset and stops on the
first problem, before any GPU time is spent on masks that are wrong."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pipeline.training.prepare.samples import Built

__all__ = ["trained_problems"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def trained_problems(tokenizer: Any, built: Built, thinking: str, stop_ids: Collection[int], finished: bool = True) -> list[str]:
    """What is wrong with the sample's loss mask; empty when it trains what the target wrote."""
    problems: list[str] = []
    covered: set[int] = set()
    for n, reply in enumerate(built.replies, 1):
        span = range(reply.start, reply.start + reply.length)
        covered.update(span)
        trained = [built.ids[i] for i in span if built.mask[i]]
        text = _flat(tokenizer.decode(trained))
        if _flat(reply.answer) not in text:
            problems.append(f"reply {n}: its answer is not trained as written")
        if reply.thought and thinking == "keep" and _flat(reply.thought) not in text:
            problems.append(f"reply {n}: its thinking is not trained (thinking = keep)")
        if reply.thought and thinking != "keep" and _flat(reply.thought) in text:
            problems.append(f"reply {n}: its thinking is trained (thinking = {thinking})")
        ended = bool(trained) and trained[-1] in stop_ids
        last = n == len(built.replies)
        if (finished or not last) and not ended:
            problems.append(f"reply {n}: its end of turn is not trained")
    stray = [i for i, m in enumerate(built.mask) if m and i not in covered]
    if stray:
        problems.append(f"{len(stray)} trained ids are not the target's (prompt or template text)")
    return problems
