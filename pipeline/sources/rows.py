"""A row to a conversation through a field map: its turns with our four roles, an optional
system prompt put first, tool schemas in OpenAI's shape, and an id. A row the map does not fit
raises RowError naming the field and listing the fields the row has.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from eagleops.pipeline.config.fields import FieldMap
from eagleops.pipeline.errors import InputError

__all__ = ["ROLE_NAMES", "RowError", "prompt_id_for", "read_row", "reply_points"]

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "ai": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "assistant",  # LLaMA-Factory: a JSON {name, arguments} call, made a tool_calls turn
}
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # carried through unchanged
_MISSING = object()


class RowError(InputError):
    """One source row is unusable; becomes a BadLine naming file, line and field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True, slots=True)
class RowConversation:
    prompt_id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None


def _text(value: str, where: str) -> str:
    """JSON can carry a lone surrogate (``"\\ud83d"``) that no UTF-8 file or request can."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError(where, f"not valid Unicode: lone surrogate {value[exc.start]!r} at character {exc.start}") from None
    return value


def _json_text(value: Any, where: str) -> Any:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError) as exc:
        raise RowError(where, f"not encodable: {exc}") from None
    return value


def _get(row: Any, dotted: str) -> Any:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _first(row: Any, candidates: tuple[str, ...], *, empty_ok: bool = False) -> tuple[str, Any]:
    """(the first candidate the row has with a value, that value), or ("", _MISSING). ``empty_ok``:
    an empty string is a value (a turn's text may be empty; an id or a prompt may not)."""
    for name in candidates:
        value = _get(row, name)
        if value is not _MISSING and value is not None and (empty_ok or value != ""):
            return name, value
    return "", _MISSING


def _has(row: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, row))) or "no fields"


def prompt_id_for(messages: tuple[dict[str, Any], ...], tools: tuple[dict[str, Any], ...] | None = None) -> str:
    canonical = json.dumps(messages if tools is None else [messages, tools], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "h" + hashlib.blake2b(canonical.encode("utf-8"), digest_size=12).hexdigest()


def _call(call: Any, where: str, turn: int, i: int) -> dict[str, Any]:
    """One tool call in OpenAI's shape (``{id, type: function, function: {name, arguments}}``,
    arguments as JSON text), from that shape or a bare ``{name, arguments}``."""
    function = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RowError(where, "a tool call needs a name ({name, arguments} or OpenAI's {type: function, function: {...}})")
    arguments = function.get("arguments", {})
    return {
        "id": str(call.get("id") or f"call_{turn}_{i}"),
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        },
    }


def _tool_call(value: str, where: str, index: int) -> dict[str, Any]:
    """LLaMA-Factory's ``function_call`` turn: ``{"name": ..., "arguments": {...}}`` as JSON text."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        raise RowError(where, "a function_call turn must hold a JSON {name, arguments} object") from None
    calls = call if isinstance(call, list) else [call]
    return {"role": "assistant", "content": "", "tool_calls": [_call(c, where, index, i) for i, c in enumerate(calls)]}


def _answered_call(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``tool_call_id`` a tool result answers: the k-th result after a call turn, its k-th call."""
    k = 0
    while k < len(turns) and turns[-1 - k]["role"] == "tool":
        k += 1
    calls = turns[-1 - k].get("tool_calls") if k < len(turns) else None
    return {"tool_call_id": calls[min(k, len(calls) - 1)]["id"]} if calls else {}


def _turns(raw: Any, key: str, fields: FieldMap) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise RowError(key, "expected a non-empty list of turns")
    roles = {**ROLE_NAMES, **fields.roles}
    turns: list[dict[str, Any]] = []
    for i, turn in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(where, "expected an object")
        role_key, role = _first(turn, fields.role)
        content_key, content = _first(turn, fields.content, empty_ok=True)
        if not isinstance(role, str):
            raise RowError(f"{where}.{role_key or fields.role[0]}", f"missing or not a string (the turn has: {_has(turn)})")
        mapped = roles.get(role.lower())
        if mapped is None:
            raise RowError(f"{where}.{role_key}", f"unknown role {role!r} (map it in [datasets.fields] roles)")
        if role.lower() == "function_call" and "function_call" not in fields.roles and isinstance(content, str):
            turns.append(_tool_call(content, f"{where}.{content_key}", i))
            continue
        if content is _MISSING and mapped in ("assistant", "system", "tool"):
            content = ""  # a turn that only calls tools, or an empty system prompt
        if not isinstance(content, str):
            raise RowError(f"{where}.{content_key or fields.content[0]}", f"missing or not a string (the turn has: {_has(turn)})")
        extra = _answered_call(turns) if mapped == "tool" and "tool_call_id" not in turn else {}
        carried = {k: _json_text(turn[k], f"{where}.{k}") for k in _TOOL_KEYS if k in turn and turn[k] is not None}
        if isinstance(carried.get("tool_calls"), list):
            carried["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", i, j) for j, c in enumerate(carried["tool_calls"])]
        turns.append({"role": mapped, "content": _text(content, f"{where}.{content_key}"), **carried, **extra})
    return turns


def _tools(row: dict[str, Any], fields: FieldMap) -> tuple[dict[str, Any], ...] | None:
    """Tool schemas in OpenAI's shape, from a list or a JSON string of one (LLaMA-Factory, xLAM)."""
    name, raw = _first(row, fields.tools)
    if raw is _MISSING:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise RowError(name, "not a JSON list of tool schemas") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise RowError(name, "expected a list of tool schemas")
    if not raw:
        return None
    tools = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool.get("function"), dict) else {k: v for k, v in tool.items() if k != "type"}
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RowError(
                f"{name}[{i}]", "a tool schema needs a name (OpenAI's {type: function, function: {name, ...}} or a bare {name, ...})"
            )
        tools.append({"type": "function", "function": _json_text(function, f"{name}[{i}]")})
    return tuple(tools)


def _prompt_turns(row: dict[str, Any], fields: FieldMap) -> list[dict[str, Any]] | None:
    name, text = _first(row, fields.prompt)
    if text is _MISSING:
        return None
    if not isinstance(text, str) or not text.strip():
        raise RowError(name, "the prompt must be non-empty text")
    input_name, extra = _first(row, fields.input)
    if isinstance(extra, str) and extra.strip() and input_name != name:
        text = f"{text}\n\n{extra}"
    turns = [{"role": "user", "content": _text(text, name)}]
    response_name, response = _first(row, fields.response)
    if isinstance(response, str) and response.strip():
        turns.append({"role": "assistant", "content": _text(response, response_name)})
    return turns


def read_row(row: Any, fields: FieldMap, regenerate: str = "last") -> RowConversation:
    """``last``: the conversation up to its last user turn (the reply to regenerate follows it);
    ``all``: every turn, the original replies marking where the target's own go."""
    if not isinstance(row, dict):
        raise RowError("<row>", f"expected an object, got {type(row).__name__}")
    key, raw = _first(row, fields.conversation)
    if raw is not _MISSING:
        turns = _turns(raw, key, fields)
    else:
        key = "|".join(fields.prompt) or "<row>"
        prompted = _prompt_turns(row, fields)
        if prompted is None:
            wanted = [f"'{n}'" for n in (*fields.conversation, *fields.prompt)]
            raise RowError(
                "<row>",
                f"no {' or '.join(wanted[:6])}{' ...' if len(wanted) > 6 else ''} field; the row has: {_has(row)} (set format or [datasets.fields])",
            )
        turns = prompted
    system_name, system = _first(row, fields.system)
    if isinstance(system, str) and system.strip() and not any(t["role"] == "system" for t in turns):
        turns.insert(0, {"role": "system", "content": _text(system, system_name)})
    if not any(t["role"] == "user" for t in turns):
        raise RowError(key, "no user turn")
    # the reply to the last user turn with words (published chats often end in an empty one,
    # or hold one mid-way: neither refuses the row); under `all` only trailing empty ones go
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user" and t["content"].strip()), default=None)
    if last_user is None:
        raise RowError(key, "every user turn is empty")
    while regenerate == "all" and turns[-1]["role"] == "user" and not turns[-1]["content"].strip():
        turns.pop()
    messages = tuple(turns if regenerate == "all" else turns[: last_user + 1])
    if regenerate == "all" and not reply_points(messages):
        raise RowError(key, "nothing for the target to write: no user or tool turn is answered in words or left unanswered at the end")
    tools = _tools(row, fields)
    id_name, own_id = _first(row, fields.id)
    if isinstance(own_id, (str, int)) and not isinstance(own_id, bool):
        return RowConversation(_text(str(own_id), id_name), messages, tools)
    return RowConversation(prompt_id_for(messages, tools), messages, tools)


def reply_points(turns: tuple[dict[str, Any], ...]) -> list[int]:
    """Indices of the turns a reply follows when every assistant turn is regenerated: each user or
    tool turn the original answered in words, and a last user or tool turn left unanswered (an
    agent's reply to a tool's result). An assistant turn that calls tools stays as it was, with
    its results: a new call would not match them."""
    points = []
    for i, turn in enumerate(turns):
        if turn["role"] not in ("user", "tool"):
            continue
        following = turns[i + 1] if i + 1 < len(turns) else None
        if following is None:
            points.append(i)
        elif following["role"] == "assistant" and not following.get("tool_calls"):
            points.append(i)
    return points
