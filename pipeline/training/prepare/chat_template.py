"""The target's own chat template, as prepare uses it: its tokenizer (never a stand-in) and
renderings of a conversation's prefix as token ids."""

from __future__ import annotations

from typing import Any

from pipeline.config import TargetConfig
from pipeline.errors import InputError
from pipeline.training.modeling.target import load_target_tokenizer

__all__ = ["PrepareError", "load_chat_tokenizer", "render_ids"]


class PrepareError(InputError):
    """Generated records, a pre-tokenized set or a chat template that prepare cannot use."""


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False, **kwargs: Any) -> list[int]:
    """The template's ids for ``messages`` (with the generation prompt: what a server feeds the
    target before its reply); ``kwargs``: the ``chat_template_kwargs`` the server was sent."""
    if not messages and not generation_prompt:
        return []
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **kwargs))


def load_chat_tokenizer(target: TargetConfig) -> Any:
    tokenizer = load_target_tokenizer(target)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{target.tokenizer_path}: the tokenizer has no chat template")
    return tokenizer
