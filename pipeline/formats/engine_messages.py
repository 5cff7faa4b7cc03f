"""Messages as the serving engine hands them to the chat template.

A request carries an assistant turn's tool-call ``arguments`` as JSON text (OpenAI's format);
vLLM (``vllm/renderers/chat_utils.py``, ``_postprocess_messages``) and SGLang
(``normalize_assistant_tool_call_arguments``) parse it into an object before any template sees
it, as transformers' docs ask of templates (recent ones iterate ``arguments.items()``). vLLM's
rules, followed here: text that is not JSON, or JSON that is not an object, becomes ``{}``;
empty or missing arguments ``{}``; an empty ``tool_calls`` list is dropped (the template takes
its plain-assistant path); ``content`` None becomes "". (SGLang refuses a request whose
arguments are not a JSON object; such a conversation never reaches a template there.) A template
that needs text (DeepSeek-V3.1 concatenates ``arguments``) fails on what the engine gives it, as
it fails in the engine: the record could not have come from it.

The copy returned shares nothing with the input (the engine parses in place; we never do).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

__all__ = ["as_engine_renders"]


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def as_engine_renders(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        message = copy.deepcopy(message)
        if message.get("content") is None:
            message["content"] = ""
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del message["tool_calls"]
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    function["arguments"] = _arguments(function.get("arguments"))
        out.append(message)
    return out
