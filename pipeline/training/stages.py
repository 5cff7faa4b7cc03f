"""The compute stages by name. Imported lazily so a generate-only run never loads torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["import_for_concurrent_stages", "stage_functions"]


def stage_functions() -> dict[str, Callable[..., Any]]:
    from pipeline.training.eval.stage import evaluate
    from pipeline.training.export.stage import export
    from pipeline.training.extract.stage import extract
    from pipeline.training.prepare.stage import prepare
    from pipeline.training.train.loop import train

    return {"prepare": prepare, "extract": extract, "train": train, "export": export, "eval": evaluate}


def import_for_concurrent_stages() -> None:
    """What two stages running side by side import, imported once first: transformers resolves
    its names lazily, and two threads doing that at once can fail ("cannot import name
    AutoModelForCausalLM")."""
    import safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: F401
