"""The target's own chat template, as prepare uses it: its tokenizer (never a stand-in) and
renderings of a conversation's prefix as token ids."""

from __future__ import annotations

from typing import Any

from eagleops.pipeline.config import TargetConfig
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.formats.engine_messages import as_engine_renders
from eagleops.pipeline.training.modeling.target import load_target_tokenizer

__all__ = ["PrepareError", "load_chat_tokenizer", "render_ids", "render_text"]


class PrepareError(InputError):
    """Generated records, a pre-tokenized set or a chat template that prepare cannot use."""


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False, **kwargs: Any) -> list[int]:
    """The template's ids for ``messages`` as the serving engine renders them (tool-call
    arguments as objects: ``as_engine_renders``), with the generation prompt where asked (what
    a server feeds the target before its reply); ``kwargs``: the ``chat_template_kwargs`` the
    server was sent. A template that fails on what the engine gives it fails here, naming why."""
    if not messages and not generation_prompt:
        return []
    return _ids(_rendered(tokenizer, messages, generation_prompt, tokenize=True, **kwargs))


def render_text(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False, **kwargs: Any) -> str:
    """``render_ids`` as the template's text, before tokenization."""
    return str(_rendered(tokenizer, messages, generation_prompt, tokenize=False, **kwargs)) if messages or generation_prompt else ""


def _rendered(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, **kwargs: Any) -> Any:
    engine = as_engine_renders(messages)
    try:
        return tokenizer.apply_chat_template(engine, add_generation_prompt=generation_prompt, **kwargs)
    except (TypeError, ValueError, _template_error()) as exc:
        if engine == messages:
            raise
        try:  # is it what the engine changed (tool-call arguments as objects) that the template cannot take?
            tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
        except (TypeError, ValueError, _template_error()):
            raise PrepareError(f"the chat template refuses this conversation: {exc}") from None
        raise PrepareError(
            f"the chat template cannot render tool calls as vLLM and SGLang give them to it (arguments parsed into objects): {exc}; "
            "the engine fails on this conversation the same way"
        ) from None


def _template_error() -> type[Exception]:
    from jinja2.exceptions import TemplateError  # transformers renders templates with jinja2

    return TemplateError


def load_chat_tokenizer(target: TargetConfig) -> Any:
    tokenizer = load_target_tokenizer(target)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{target.tokenizer_path}: the tokenizer has no chat template")
    return tokenizer
