"""What prepare reads: every dataset's generated conversations (deduplicated by prompt, turns
kept as the template needs them) and pre-tokenized extra sets, and the fingerprint of it all
that tells whether an earlier prepare is still up to date."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.config.run import THINKING
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.modeling.target import require_target
from eagleops.pipeline.training.prepare.chat_template import PrepareError

__all__ = ["Sample", "fingerprint", "read_conversations", "read_extra"]

Sample = tuple[list[int], list[int]]  # (input_ids, loss_mask)
# how samples are built (2: the sequence the target processed; 3: tool calls as the engine renders
# them, the server's prompt ids where it gave them); a change re-prepares
SAMPLE_RULE = 3


def _prompt_key(messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
    prompt: Any = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    if tools:  # the same question with other tools is another prompt
        prompt = [prompt, tools]
    return hashlib.blake2b(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode(), digest_size=12).hexdigest()


_TEMPLATE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")  # what templates read besides role and content


def _turn(message: dict[str, Any]) -> dict[str, Any]:
    turn = {"role": message["role"], "content": message["content"]}
    turn.update({key: message[key] for key in _TEMPLATE_KEYS if key in message})
    return turn


def read_conversations(config: RunConfig, ctx: StageContext) -> tuple[list[dict[str, Any]], int]:
    seen: set[str] = set()
    rows, duplicates = [], 0
    for ds in config.datasets:
        path = config.layout.dataset(ds.name).data
        if not path.exists():
            ctx.log("warning", f"prepare: {path} missing (dataset {ds.name} not generated); skipped")
            continue
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                    messages = record["conversations"]
                    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
                        raise ValueError("conversations: must end with an assistant turn")
                    messages = [_turn(m) for m in messages]
                    thinking = record.get("thinking", "keep")
                    if thinking not in THINKING:
                        raise ValueError(f"thinking is {thinking!r}, not one of {', '.join(THINKING)}")
                except KeyError as exc:
                    raise PrepareError(f"{path}:{line_no}: field {exc} missing") from None
                except (ValueError, TypeError, AttributeError) as exc:
                    raise PrepareError(f"{path}:{line_no}: {exc}") from None
                tools = record.get("tools") or None
                key = _prompt_key(messages, tools)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
                exact = record.get("completion_token_ids")
                trained = record.get("target_turns")  # absent in older outputs: every assistant turn
                replies = record.get("reply_token_ids")  # every reply's ids, for a regenerated chat
                exact_turns = dict(zip(trained, replies, strict=True)) if trained and replies and len(replies) == len(trained) else {}
                served_prompts = _served_prompts(record, trained, len(messages) - 1)
                rows.append(
                    {
                        "key": key,
                        "id": str(record.get("id", key)),
                        "dataset": ds.name,
                        "messages": messages,
                        "exact": exact,
                        "exact_turns": exact_turns,
                        "trained": trained,
                        "thinking": thinking,
                        "finished": record.get("finish_reason") != "length",
                        "tools": tools,
                        "served_prompts": served_prompts,
                    }
                )
    return rows, duplicates


def _served_prompts(record: dict[str, Any], trained: list[int] | None, last: int) -> dict[int, list[int]]:
    """The prompt ids the server fed the target before each reply, by the reply's index."""
    each = record.get("reply_prompt_ids")
    if trained and isinstance(each, list) and len(each) == len(trained):
        return dict(zip(trained, each, strict=True))
    single = record.get("prompt_token_ids")
    return {last: single} if isinstance(single, list) and single else {}


def read_extra(path: Path, max_length: int) -> list[Sample]:
    samples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids, mask = row["input_ids"], row["loss_mask"]
                if len(ids) != len(mask) or not all(isinstance(i, int) for i in ids):
                    raise ValueError("input_ids and loss_mask must be integer lists of equal length")
            except (ValueError, KeyError, TypeError) as exc:
                raise PrepareError(f"{path}:{line_no}: {exc}") from None
            samples.append((ids[:max_length], [int(bool(m)) for m in mask[:max_length]]))
    return samples


def fingerprint(config: RunConfig) -> str:
    h = hashlib.blake2b(digest_size=12)
    for ds in config.datasets:
        manifest = config.layout.dataset(ds.name).manifest
        h.update(ds.name.encode())
        h.update(manifest.read_bytes() if manifest.exists() else b"-")
    for extra in config.prepare.extra:
        h.update(str(extra).encode())
        h.update(str(extra.stat().st_size if extra.exists() else -1).encode())
    tokenizer = require_target(config).tokenizer_path
    switches = [config.sampling.thinking_on_kwargs, config.sampling.thinking_off_kwargs]  # they shape each prompt
    h.update(json.dumps([SAMPLE_RULE, str(tokenizer), config.prepare.__dict__, switches], default=str, sort_keys=True).encode())
    return h.hexdigest()
