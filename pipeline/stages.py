"""The compute stages by name. Imported lazily so a generate-only run never loads torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["stage_functions"]


def stage_functions() -> dict[str, Callable[..., Any]]:
    from .evaluate import evaluate
    from .export import export
    from .extract import extract
    from .prepare import prepare
    from .train import train

    return {"prepare": prepare, "extract": extract, "train": train, "export": export, "eval": evaluate}
