"""The compute stages' functions, imported when one starts (``pipeline.stages`` names each one's
entry), so a generate-only run never loads torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from eagleops.pipeline.stages import stage

__all__ = ["import_for_concurrent_stages", "stage_function"]


def stage_function(name: str) -> Callable[..., Any]:
    """The function that runs compute stage ``name``: ``(config, ctx) -> result``."""
    entry = stage(name).entry
    if entry is None:
        raise KeyError(f"{name} is not a compute stage: the engine runs it on its event loop")
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(module), function)


def import_for_concurrent_stages() -> None:
    """What two stages running side by side import, imported once first: transformers resolves
    its names lazily, and two threads doing that at once can fail ("cannot import name
    AutoModelForCausalLM")."""
    import safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: F401
