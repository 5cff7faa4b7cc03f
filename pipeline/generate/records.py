"""The lines generate writes: a record per reply the target wrote (data.jsonl), a failure per
row that could not be made (failed.jsonl). Both name the dataset and the source position, so a
record can always be traced back to its prompt."""

from __future__ import annotations

import time
from typing import Any

from eagleops.pipeline.generate.client import Completion
from eagleops.pipeline.sources import BadLine, Prompt

__all__ = ["bad_line_record", "failed_request_record", "generated_record", "skipped_record"]


def generated_record(
    prompt: Prompt,
    dataset: str,
    conversation: list[dict[str, Any]],
    completion: Completion,
    written: list[int],
    *,
    model: str,
    thinking: str,
    dropped: int = 0,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": prompt.prompt_id,
        "conversations": conversation,
        "target_turns": written,  # the replies the target wrote: the only ones trained on
        "dataset": dataset,
        "source_offset": prompt.offset,
        "source_line": prompt.line,
        "finish_reason": completion.finish_reason,
        "truncated": completion.finish_reason == "length",
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "usage_source": completion.usage_source,
        "endpoint": completion.endpoint,
        "model": model,
        "latency_s": round(completion.latency_s, 4),
        "attempts": completion.attempts,
        "cost": completion.cost,
        "thinking": thinking,  # drop: the reasoning is kept here but not trained on
        "reasoning_tokens": completion.reasoning_tokens,
        "finished_at": round(time.time(), 3),
    }
    if dropped:
        record["dropped_messages"] = dropped  # the row's earliest messages, left out so that the reply could be trained
    if prompt.tools:
        record["tools"] = list(prompt.tools)  # prepare renders them as the server did
    if prompt.shard:
        record["source_file"] = prompt.shard
    if completion.token_ids is not None:
        record["completion_token_ids"] = list(completion.token_ids)
    if completion.prompt_ids is not None:  # what the target processed: prepare trains on it as it is
        record["prompt_token_ids"] = list(completion.prompt_ids)
    earlier = completion.reply_token_ids
    if len(earlier) > 1 and all(ids is not None for ids in earlier):  # each reply of the chat, as target_turns
        record["reply_token_ids"] = [list(ids) for ids in earlier if ids is not None]
    prompts = completion.reply_prompt_ids
    if len(prompts) > 1 and all(ids is not None for ids in prompts):
        record["reply_prompt_ids"] = [list(ids) for ids in prompts if ids is not None]
    return record


def failed_request_record(prompt: Prompt, dataset: str, reason: str, attempts: int | None) -> dict[str, Any]:
    return {
        "id": prompt.prompt_id,
        "kind": "request",
        "dataset": dataset,
        "source_offset": prompt.offset,
        "source_line": prompt.line,
        **({"source_file": prompt.shard} if prompt.shard else {}),
        "reason": reason,
        "attempts": attempts,
    }


def skipped_record(prompt: Prompt, dataset: str, reason: str) -> dict[str, Any]:
    """A row not sent because its reply could not be trained (``fit``): nothing paid for it."""
    return {**failed_request_record(prompt, dataset, reason, 0), "kind": "skipped"}


def bad_line_record(item: BadLine, dataset: str) -> dict[str, Any]:
    return {
        "id": f"line:{item.line}",
        "kind": "bad_line",
        "dataset": dataset,
        "source_offset": item.offset,
        "source_line": item.line,
        "field": item.field,
        "reason": item.message,
    }
