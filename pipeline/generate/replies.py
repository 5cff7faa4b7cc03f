"""What a chat-completion request asks and what its reply says, across servers' dialects.

Thinking: vLLM puts it in ``message.reasoning`` (``reasoning_content`` is its deprecated name),
SGLang in ``message.reasoning_content`` (with ``--reasoning-parser``), OpenRouter in
``message.reasoning``; a server without a parser leaves it inline, ``<think>...</think>`` at the
start of the content. Turning it off is a chat-template switch for vLLM and SGLang
(``chat_template_kwargs``, in the words of the target's template: ``enable_thinking`` for Qwen3,
``thinking`` for Kimi-K2.5 and DeepSeek-V3.1) and ``reasoning.enabled`` for OpenRouter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MalformedReply", "Reply", "parse_reply", "request_fields", "thinking_off_fields"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class MalformedReply(ValueError):
    """A 200 whose body is not a chat completion: retried like a transient failure."""


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    token_ids: tuple[int, ...] | None
    cost: float | None


def thinking_off_fields(kind: str, base_url: str, template_switch: dict[str, Any] | None = None) -> dict[str, Any]:
    """``template_switch``: the kwargs the target's own chat template reads (Kimi-K2.5 and
    DeepSeek-V3.1 ``thinking``, Qwen3 ``enable_thinking``); Qwen3's where none is known."""
    if kind == "openrouter" or (kind == "auto" and "openrouter.ai" in base_url):
        return {"reasoning": {"enabled": False}}
    return {"chat_template_kwargs": dict(template_switch) if template_switch else {"enable_thinking": False}}


def request_fields(
    extra: dict[str, Any], *, kind: str, base_url: str, thinking: str, template_switch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run file's extra fields, plus what the thinking mode and the server kind ask for."""
    fields = dict(extra)
    if thinking == "off":
        for key, value in thinking_off_fields(kind, base_url, template_switch).items():
            fields[key] = {**(fields.get(key) or {}), **value}
    if kind == "vllm":
        fields.setdefault("return_token_ids", True)  # the exact tokens, for prepare
    return fields


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _split_inline(text: str) -> tuple[str, str | None]:
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        thought, _, answer = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
        return answer.lstrip("\n"), thought.strip()
    return text, None


def _utf8(text: str, field: str) -> str:
    """Text we will write as UTF-8: a lone surrogate (a server's broken escape) cannot be, and is
    the server's fault, not the row's: the reply is malformed, and retried."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MalformedReply(f"malformed response ({field} is not valid Unicode: {exc.reason} at {exc.start})") from None
    return text


def _table(payload: dict[str, Any], key: str) -> dict[str, Any]:
    value = payload.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedReply(f"malformed response ({key} is a {type(value).__name__}, not an object)")
    return value


def parse_reply(raw: bytes) -> Reply:
    try:
        payload = json.loads(raw)
        choice = payload["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        if not isinstance(text, str):
            raise TypeError("content is not a string")
        finish = choice.get("finish_reason") or "unknown"
        if not isinstance(finish, str):
            raise TypeError("finish_reason is not a string")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MalformedReply(f"malformed response ({type(exc).__name__}: {str(exc)[:80]})") from None
    text = _utf8(text, "content")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        reasoning = _utf8(reasoning, "reasoning").strip()  # the template puts its own newlines around it
    else:
        text, reasoning = _split_inline(text)
    usage = _table(payload, "usage")
    details = usage.get("completion_tokens_details") or {}
    ids = choice.get("token_ids")
    token_ids = tuple(ids) if isinstance(ids, list) and all(_count(i) is not None for i in ids) else None
    cost = usage.get("cost")
    return Reply(
        text=text,
        reasoning=reasoning,
        finish_reason=finish,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        reasoning_tokens=_count(details.get("reasoning_tokens")) if isinstance(details, dict) else None,
        token_ids=token_ids,
        cost=float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0 else None,
    )
