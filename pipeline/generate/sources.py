"""Prompt datasets: JSONL rows in ShareGPT (`conversations`), OpenAI/UltraChat (`messages`)
or plain `prompt` form, read from a byte offset so a resumed run never re-reads what it passed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

__all__ = ["BadLine", "Prompt", "SourceReader", "parse_row", "prompt_id_for", "reply_points"]

_ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # carried through unchanged


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request to make: the conversation up to (and including) its last user turn."""

    prompt_id: str
    messages: tuple[dict[str, Any], ...]
    offset: int  # byte offset of the source line
    end: int  # byte offset just past it
    line: int  # 1-based line number in the source


@dataclass(frozen=True, slots=True)
class BadLine:
    """A source row that cannot be used; ``message`` reads ``file:line: field: why``."""

    path: str
    line: int
    offset: int
    end: int
    field: str
    reason: str

    @property
    def message(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.reason}"


class RowError(InputError):
    """One source row is unusable; becomes a BadLine naming file, line and field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


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


def prompt_id_for(messages: tuple[dict[str, Any], ...]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "h" + hashlib.blake2b(canonical.encode("utf-8"), digest_size=12).hexdigest()


def _turns(raw: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise RowError(key, "expected a non-empty list of turns")
    turns = []
    for i, turn in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(where, "expected an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str):
            raise RowError(f"{where}.role", "missing or not a string")
        mapped = _ROLE_ALIASES.get(role.lower())
        if mapped is None:
            raise RowError(f"{where}.role", f"unknown role {role!r}")
        if content is None and mapped == "assistant" and isinstance(turn.get("tool_calls"), list):
            content = ""  # a turn that only calls tools
        if not isinstance(content, str):
            raise RowError(f"{where}.content", "missing or not a string")
        tools = {k: _json_text(turn[k], f"{where}.{k}") for k in _TOOL_KEYS if k in turn}
        turns.append({"role": mapped, "content": _text(content, f"{where}.content"), **tools})
    return turns


def parse_row(row: Any, fmt: str, id_field: str, regenerate: str = "last") -> tuple[str, tuple[dict[str, Any], ...]]:
    """Return (prompt_id, messages). ``last``: the conversation up to its last user turn (the reply
    to regenerate follows it); ``all``: every turn, the original replies marking where the
    target's own go. Raises RowError naming the field."""
    if not isinstance(row, dict):
        raise RowError("<row>", "expected a JSON object")
    if fmt == "auto":
        fmt = next((k for k in ("conversations", "messages", "prompt") if k in row), "")
        if not fmt:
            raise RowError("<row>", "no 'conversations', 'messages' or 'prompt' field")
    if fmt == "prompt":
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise RowError("prompt", "missing or empty")
        turns = [{"role": "user", "content": _text(text, "prompt")}]
        system = row.get("system")
        if isinstance(system, str) and system:
            turns.insert(0, {"role": "system", "content": _text(system, "system")})
    else:
        if fmt not in row:
            raise RowError(fmt, "missing")
        turns = _turns(row[fmt], fmt)
    # Regenerate the reply to the last user turn; later (original) assistant turns are dropped.
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        raise RowError(fmt, "no user turn")
    if not turns[last_user]["content"].strip():
        raise RowError(f"{fmt}[{last_user}].content", "empty user turn")
    messages = tuple(turns if regenerate == "all" else turns[: last_user + 1])
    if regenerate == "all" and not reply_points(messages):
        raise RowError(fmt, "nothing for the target to write: no user or tool turn is answered in words or left unanswered at the end")
    own_id = row.get(id_field)
    if isinstance(own_id, (str, int)) and not isinstance(own_id, bool) and str(own_id):
        return _text(str(own_id), id_field), messages
    return prompt_id_for(messages), messages


class SourceReader:
    """Iterates a JSONL source from a byte offset, yielding Prompt or BadLine."""

    def __init__(self, path: Path, fmt: str = "auto", id_field: str = "id", *, offset: int = 0, line: int = 0, regenerate: str = "last"):
        self.path, self.fmt, self.id_field, self.regenerate = path, fmt, id_field, regenerate
        self.start_offset, self.start_line = offset, line

    def __iter__(self) -> Iterator[Prompt | BadLine]:
        offset, line_no = self.start_offset, self.start_line
        with open(self.path, "rb") as f:
            f.seek(offset)
            for raw in f:
                line_no += 1
                here = offset
                offset += len(raw)
                text = raw.strip()
                if not text:
                    continue  # blank lines carry nothing; the next item's end moves past them
                try:
                    row = json.loads(text)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield BadLine(str(self.path), line_no, here, offset, "<json>", f"invalid JSON ({getattr(exc, 'msg', exc)})")
                    continue
                try:
                    pid, messages = parse_row(row, self.fmt, self.id_field, self.regenerate)
                except RowError as exc:
                    yield BadLine(str(self.path), line_no, here, offset, exc.field, exc.reason)
                    continue
                except Exception as exc:  # a row no check foresaw: still this row's failure, never the dataset's
                    yield BadLine(str(self.path), line_no, here, offset, "<row>", f"{type(exc).__name__}: {exc}")
                    continue
                yield Prompt(pid, messages, here, offset, line_no)

    def batches(self, size: int = 256) -> Iterator[list[Prompt | BadLine]]:
        batch: list[Prompt | BadLine] = []
        for item in self:
            batch.append(item)
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch


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
        elif following is not None and following["role"] == "assistant" and not following.get("tool_calls"):
            points.append(i)
    return points
