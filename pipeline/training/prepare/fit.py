"""The prompt's length as prepare will render it, for generate to check before it sends a request
(``eagleops.pipeline.generate.fit``): the target's own template, with the thinking switch and the tool
schemas the server is sent, exactly as ``SampleBuilder`` renders a sample's prompt."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.config.run import THINKING
from eagleops.pipeline.training.modeling.profile import target_profile
from eagleops.pipeline.training.modeling.target import require_target
from eagleops.pipeline.training.modeling.thinking_switch import template_kwargs
from eagleops.pipeline.training.prepare.chat_template import load_chat_tokenizer, render_ids

__all__ = ["prompt_counter"]


def prompt_counter(config: RunConfig) -> Callable[[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None, str], int]:
    """Counts a prompt's tokens, generation prompt included (blocking: the engine calls it from
    generate's worker threads, one at a time)."""
    tokenizer = load_chat_tokenizer(require_target(config))
    switch = target_profile(config).thinking_switch
    kwargs = {mode: template_kwargs(config, switch, mode) for mode in THINKING}
    lock = threading.Lock()  # a fast tokenizer's Rust state is not shared between threads

    def count(messages: tuple[dict[str, Any], ...], tools: tuple[dict[str, Any], ...] | None, thinking: str) -> int:
        given = {**kwargs[thinking], "tools": list(tools)} if tools else kwargs[thinking]
        with lock:
            return len(render_ids(tokenizer, list(messages), generation_prompt=True, **given))

    return count
