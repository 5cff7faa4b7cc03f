"""Regenerating a whole conversation: every assistant turn in order, each from the target with its
own earlier replies in the history, so nothing another model wrote is trained on as the target's.

The conversation becomes one record only when its last reply is in: a kill in the middle leaves
nothing behind, and resume redoes the conversation from its first turn. Once the dataset's limit
is reached, a conversation asks for no further turn: its record ends at the last reply it has
(every reply in it still the target's), so a budget is overshot by at most what was in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from eagleops.pipeline.config import DatasetConfig
from eagleops.pipeline.generate.client import ChatClient, Completion
from eagleops.pipeline.generate.fit import Fitted, PromptFit, Skipped, TooLong
from eagleops.pipeline.sources import Prompt, reply_points

__all__ = ["assistant_turn", "regenerate", "regenerate_all", "regenerate_last"]


def assistant_turn(completion: Completion) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": completion.text}
    if completion.tool_calls:  # the target called a tool: kept as the template renders it
        turn["tool_calls"] = list(completion.tool_calls)
    if completion.reasoning:
        turn["reasoning_content"] = completion.reasoning  # the name chat templates read
    return turn


def _combined(completions: list[Completion]) -> Completion:
    """One record's accounting for several replies: sums, and the last reply's endpoint."""
    last = completions[-1]
    known_prompts = [c.prompt_tokens for c in completions if c.prompt_tokens is not None]
    costs = [c.cost for c in completions if c.cost is not None]
    return dataclasses.replace(
        last,
        finish_reason="length" if any(c.finish_reason == "length" for c in completions) else last.finish_reason,
        prompt_tokens=sum(known_prompts) if known_prompts else None,
        completion_tokens=sum(c.completion_tokens for c in completions),
        reasoning_tokens=sum(c.reasoning_tokens for c in completions),
        latency_s=sum(c.latency_s for c in completions),
        attempts=sum(c.attempts for c in completions),
        cost=sum(costs) if costs else None,
        reply_token_ids=tuple(c.token_ids for c in completions),
        reply_prompt_ids=tuple(c.prompt_ids for c in completions),
        reply_capture_marks=tuple(c.capture_mark for c in completions),
    )


async def regenerate(
    client: ChatClient,
    prompt: Prompt,
    dataset: DatasetConfig,
    thinking: str,
    fit: PromptFit | None,
    *,
    may_go_on: Callable[[], bool],
    on_reply: Callable[[Completion], None],
) -> tuple[list[dict[str, Any]], Completion, list[int], int]:
    """The dataset's regeneration of one row: (conversation, accounting, the target's replies,
    earliest messages left out to fit)."""
    if dataset.regenerate == "all":
        found = await regenerate_all(client, prompt.messages, thinking, may_go_on=may_go_on, on_reply=on_reply, tools=prompt.tools, fit=fit)
        return (*found, 0)
    return await regenerate_last(client, prompt, thinking, fit, shorten=dataset.long_prompts == "drop-oldest")


async def regenerate_last(
    client: ChatClient, prompt: Prompt, thinking: str, fit: PromptFit | None, *, shorten: bool
) -> tuple[list[dict[str, Any]], Completion, list[int], int]:
    """(the conversation with the target's reply, its accounting, the index of that reply, the
    earliest messages left out to fit). Raises ``Skipped`` for a prompt too long to train."""
    messages, max_tokens, dropped = prompt.messages, None, 0
    if fit is not None:
        fitted = await asyncio.to_thread(fit.fit, messages, prompt.tools, thinking, shorten=shorten)
        if isinstance(fitted, TooLong):
            raise Skipped(fitted.reason)
        messages, max_tokens, dropped = fitted.messages, fitted.max_tokens, fitted.dropped
    completion = await client.complete(messages, thinking=thinking, tools=prompt.tools, max_tokens=max_tokens)
    return [*messages, assistant_turn(completion)], completion, [len(messages)], dropped


async def regenerate_all(
    client: ChatClient,
    turns: tuple[dict[str, Any], ...],
    thinking: str,
    *,
    may_go_on: Callable[[], bool] = lambda: True,
    on_reply: Callable[[Completion], None] = lambda completion: None,
    tools: tuple[dict[str, Any], ...] | None = None,
    fit: PromptFit | None = None,
) -> tuple[list[dict[str, Any]], Completion, list[int]]:
    """(the conversation with the target's replies, their combined accounting, the indices of the
    replies the target wrote: the ones to train on). ``may_go_on`` is asked before every reply
    but the first; ``on_reply`` hears of each reply as it comes. With ``fit``, a reply whose
    prompt leaves too little room ends the conversation before it is asked for (``Skipped``
    when that is the first)."""
    points = set(reply_points(turns))
    sent: list[dict[str, Any]] = []  # what the server sees: role and content, as any server takes
    kept: list[dict[str, Any]] = []  # what the record keeps: the thinking too
    completions: list[Completion] = []
    written: list[int] = []
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant" and not turn.get("tool_calls"):
            continue  # another model's words: replaced by the target's own
        sent.append(turn)
        kept.append(turn)
        if i in points:
            fitted = await asyncio.to_thread(fit.fit, tuple(sent), tools, thinking, shorten=False) if fit is not None else None
            if isinstance(fitted, TooLong) and not completions:
                raise Skipped(fitted.reason)
            if completions and (isinstance(fitted, TooLong) or not may_go_on()):
                del kept[written[-1] + 1 :]  # the record ends at the target's last reply
                break
            max_tokens = fitted.max_tokens if isinstance(fitted, Fitted) else None
            completion = await client.complete(tuple(sent), thinking=thinking, tools=tools, max_tokens=max_tokens)
            on_reply(completion)
            completions.append(completion)
            sent.append(
                {
                    "role": "assistant",
                    "content": completion.text,
                    **({"tool_calls": list(completion.tool_calls)} if completion.tool_calls else {}),
                }
            )
            written.append(len(kept))
            kept.append(assistant_turn(completion))
            if completion.tool_calls:  # a call the original never made: no later turn answers it, so the record ends here
                break
    return kept, _combined(completions), written
