"""``[sampling] extra``: any field a server takes, but none that breaks the protocol."""

from __future__ import annotations

from typing import Any

from .schema import Check

__all__ = ["REQUEST_FIELDS"]

# Request fields eagleops sets itself, or that would break how it reads a reply (one choice, whole).
_FIELDS_WE_SET = {
    "model": "the endpoint's `model` names it",
    "messages": "they come from the dataset",
    "max_tokens": "use sampling.max_tokens",
    "max_completion_tokens": "use sampling.max_tokens",
    "temperature": "use sampling.temperature",
    "top_p": "use sampling.top_p",
    "stream": "replies are read whole",
    "n": "one reply per request is recorded",
}
_TABLE_FIELDS = ("chat_template_kwargs", "reasoning")  # merged with what a thinking mode asks for


class _RequestFields(Check):
    """``[sampling] extra``: any field a server takes, but none that breaks the protocol."""

    def problem(self, value: Any) -> str | None:
        for key, why in _FIELDS_WE_SET.items():
            if key in value:
                return f"`{key}` is not an extra field ({why}); remove it"
        for key in _TABLE_FIELDS:
            if key in value and not isinstance(value[key], dict):
                return f"`{key}` must be a table (e.g. {key} = {{ enable_thinking = false }}), got {value[key]!r}"
        return None


REQUEST_FIELDS = _RequestFields(lambda v: True, "fields that keep the protocol")
