"""Where the target's turn ends, learned from its own chat template.

A tokenizer's eos is not always the token that closes a reply: Kimi-K2.5's eos is ``[EOS]`` while
its turns end with ``<|im_end|>``, and gpt-oss ends its last turn with ``<|return|>`` but history
turns with ``<|end|>``. A table of model names would go stale, so the template is asked: render a
conversation with marked assistant replies and read the token that follows each reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["reply_stop_ids", "turn_ends"]

# replies no template alters (no spaces to strip, no tags to parse)
_HISTORY_REPLY = "eagleopsprobehistoryreply"
_LAST_REPLY = "eagleopsprobelastreply"


def _special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})


def _token_after(tokenizer: Any, text: str, reply: str, special: set[int]) -> int | None:
    """The special token the template writes right after ``reply``; None where it writes none
    (a plain-text separator is template text, not something the target emits to stop)."""
    at = text.rfind(reply)
    if at < 0:
        return None
    following = tokenizer.encode(text[at + len(reply) :], add_special_tokens=False)
    return following[0] if following and following[0] in special else None


def turn_ends(tokenizer: Any) -> tuple[int, ...]:
    """The ids that close an assistant turn in the template: first the last turn's (what the
    target emits to end its reply), then a history turn's where it differs. The tokenizer's eos
    where the template shows neither."""
    conversation = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": _HISTORY_REPLY},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": _LAST_REPLY},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    special = _special_ids(tokenizer)
    found = [_token_after(tokenizer, text, reply, special) for reply in (_LAST_REPLY, _HISTORY_REPLY)]
    ends = tuple(dict.fromkeys(end for end in found if end is not None))
    if ends:
        return ends
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


def _generation_config_eos(model_dir: Path) -> list[int]:
    """generation_config.json's eos_token_id: one id or a list (Llama-3.1 and gpt-oss list several)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    listed = json.loads(path.read_text()).get("eos_token_id")
    if listed is None:
        return []
    return [int(i) for i in listed] if isinstance(listed, list) else [int(listed)]


def reply_stop_ids(tokenizer: Any, model_dir: Path) -> frozenset[int]:
    """Every id on which serving ends a reply: the template's last-turn end, generation_config's
    eos ids (what vLLM stops on) and the tokenizer's eos. A history-only end (gpt-oss ``<|end|>``)
    is left out: the target writes it mid-reply, between its channels."""
    stops = set(turn_ends(tokenizer)[:1])
    stops.update(_generation_config_eos(model_dir))
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return frozenset(stops)
