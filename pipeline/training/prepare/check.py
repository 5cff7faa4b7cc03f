"""Whether a sample trains exactly what the target wrote: its answer and end of turn always, its
thinking under ``keep`` only, and nothing of the prompt or the template's own text. ``eagleops
inspect`` shows it; prepare runs it on the first samples of every dataset and stops on the
first problem, before any GPU time is spent on masks that are wrong."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from eagleops.pipeline.formats.thinking import THINK_CLOSE, THINK_OPEN
from eagleops.pipeline.training.prepare.samples import Built

__all__ = ["trained_problems"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _droppable_texts(tokenizer: Any) -> list[str]:
    """What a server may leave out of a reply's text, longest first: the special added tokens
    (skipped when it decodes) and the thinking tags (its reasoning parser strips them)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {token.content for token in added.values() if getattr(token, "special", False)}
    texts |= {*tokenizer.all_special_tokens, THINK_OPEN, THINK_CLOSE}
    return sorted((t for t in texts if t), key=len, reverse=True)


def _without(text: str, specials: list[str]) -> str:
    for special in specials:
        text = text.replace(special, "")
    return _flat(text)


def _trains(text: str, trained: str, specials: list[str]) -> bool:
    """Whether ``text`` (a reply's answer or thought, as the server decoded it) is in the
    decoded trained ids: as it is, or both without what servers leave out, which they do not
    all do alike (vLLM drops the ``</think>`` a sampled model wrote twice from the answer, and
    a ``<think>`` in mid-thought, but keeps a stray ``<|end_header_id|>`` in the reasoning)."""
    return _flat(text) in _flat(trained) or _without(text, specials) in _without(trained, specials)


def trained_problems(tokenizer: Any, built: Built, thinking: str, stop_ids: Collection[int], finished: bool = True) -> list[str]:
    """What is wrong with the sample's loss mask; empty when it trains what the target wrote."""
    problems: list[str] = []
    covered: set[int] = set()
    specials = _droppable_texts(tokenizer)
    for n, reply in enumerate(built.replies, 1):
        span = range(reply.start, reply.start + reply.length)
        covered.update(span)
        trained = [built.ids[i] for i in span if built.mask[i]]
        decoded = tokenizer.decode(trained)

        def trains(text: str, decoded: str = decoded) -> bool:
            return _trains(text, decoded, specials)

        if not trains(reply.answer):
            problems.append(f"reply {n}: its answer is not trained as written")
        if reply.thought and thinking == "keep" and not trains(reply.thought):
            problems.append(f"reply {n}: its thinking is not trained (thinking = keep)")
        if reply.thought and thinking != "keep" and trains(reply.thought):
            problems.append(f"reply {n}: its thinking is trained (thinking = {thinking})")
        ended = bool(trained) and trained[-1] in stop_ids
        last = n == len(built.replies)
        if (finished or not last) and not ended:
            problems.append(f"reply {n}: its end of turn is not trained")
    stray = [i for i, m in enumerate(built.mask) if m and i not in covered]
    if stray:
        problems.append(f"{len(stray)} trained ids are not the target's (prompt or template text)")
    return problems
