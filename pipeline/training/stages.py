"""The compute stages by name. Imported lazily so a generate-only run never loads torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["stage_functions"]


def stage_functions() -> dict[str, Callable[..., Any]]:
    from pipeline.training.evaluate import evaluate
    from pipeline.training.export import export
    from pipeline.training.extract import extract
    from pipeline.training.prepare import prepare
    from pipeline.training.train import train

    return {"prepare": prepare, "extract": extract, "train": train, "export": export, "eval": evaluate}
