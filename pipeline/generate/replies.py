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

from eagleops.pipeline.formats.thinking import split_thinking

__all__ = ["MalformedReply", "Reply", "parse_reply", "request_fields", "thinking_off_fields"]


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
    tool_calls: tuple[dict[str, Any], ...] = ()  # the target's calls of the request's tools, as the server parsed them
    prompt_ids: tuple[int, ...] | None = None  # the ids the server fed the target (vLLM's ``return_token_ids``)
    capture_mark: str | None = None  # the request's X-Request-Id, where the server captures it (during_generate)


def _routed(kind: str, base_url: str) -> bool:
    return kind == "openrouter" or (kind == "auto" and "openrouter.ai" in base_url)


def thinking_off_fields(kind: str, base_url: str, template_switch: dict[str, Any] | None = None) -> dict[str, Any]:
    """``template_switch``: the kwargs the target's own chat template reads (Kimi-K2.5 and
    DeepSeek-V3.1 ``thinking``, Qwen3 ``enable_thinking``, gpt-oss ``reasoning_effort``); Qwen3's
    where none is known."""
    if _routed(kind, base_url):
        return {"reasoning": {"enabled": False}}
    return _template_fields(template_switch or {"enable_thinking": False})


def _template_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template's switch as ``chat_template_kwargs``; a reasoning effort also as the OpenAI
    field of that name, which is what vLLM's and SGLang's harmony paths (gpt-oss) read."""
    fields: dict[str, Any] = {"chat_template_kwargs": dict(kwargs)}
    if "reasoning_effort" in kwargs:
        fields["reasoning_effort"] = kwargs["reasoning_effort"]
    return fields


def request_fields(
    extra: dict[str, Any],
    *,
    kind: str,
    base_url: str,
    thinking: str,
    template_switch: dict[str, Any] | None = None,
    template_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run file's extra fields, plus what the thinking mode and the server kind ask for:
    ``template_switch`` turns thinking off, ``template_on`` on (DeepSeek-V3.1 thinks only when
    asked), each in the words of the target's own template."""
    fields = dict(extra)
    if thinking == "off":
        wanted = thinking_off_fields(kind, base_url, template_switch)
    else:
        wanted = _template_fields(template_on) if template_on and not _routed(kind, base_url) else {}
    for key, value in wanted.items():
        fields[key] = {**(fields.get(key) or {}), **value} if isinstance(value, dict) else fields.get(key, value)
    if kind == "vllm":
        fields.setdefault("return_token_ids", True)  # the exact tokens, for prepare
    return fields


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
    reasoning = _utf8(reasoning, "reasoning") if isinstance(reasoning, str) else None
    text, reasoning = split_thinking(text, reasoning)  # thinking the parser missed is thinking too
    usage = _table(payload, "usage")
    details = usage.get("completion_tokens_details") or {}
    token_ids, prompt_ids = _ids(choice.get("token_ids")), _ids(payload.get("prompt_token_ids"))
    cost = usage.get("cost")
    calls = message.get("tool_calls")
    tool_calls = tuple(c for c in calls if isinstance(c, dict)) if isinstance(calls, list) else ()
    return Reply(
        text=text,
        reasoning=reasoning,
        finish_reason=finish,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        reasoning_tokens=_count(details.get("reasoning_tokens")) if isinstance(details, dict) else None,
        token_ids=token_ids,
        cost=float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0 else None,
        tool_calls=tool_calls,
        prompt_ids=prompt_ids,
    )


def _ids(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if isinstance(value, list) and all(_count(i) is not None for i in value) else None
