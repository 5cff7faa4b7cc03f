"""``train/checkpoint.pt`` as train writes and resumes it: the drafter without the frozen
embeddings, optimiser, schedule and position, and the capture layout of the features it was
trained on, which a resume checks against the features it is given now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagleops.pipeline.training.artifacts import INDEX, CaptureLayout, Checkpoint

__all__ = ["checkpoint_to_resume", "write_checkpoint"]


def write_checkpoint(
    path: Path,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    *,
    step: int,
    history: list[dict[str, Any]],
    capture: CaptureLayout,
    drafter_config: dict[str, Any],
    global_batch: int,
) -> None:
    weights = {k: v for k, v in model_state.items() if not k.startswith("embed_tokens.")}  # the target's: never trained, never saved
    Checkpoint(weights, optimizer_state, scheduler_state, step, history, capture, drafter_config, global_batch).save(path)


def checkpoint_to_resume(path: Path, device: Any, capture: CaptureLayout, features_dir: Path) -> Checkpoint | None:
    """The checkpoint to go on from, if there is one; ``CaptureMismatch`` if it was trained on
    other layers than the features in ``features_dir`` hold."""
    if not path.exists():
        return None
    state = Checkpoint.load(path, map_location=device)
    state.capture.require_match(
        path,
        capture,
        features_dir / INDEX,
        f"the features were extracted again with other layers since; delete {path.name} to train afresh, "
        "or extract with the layers it was trained on",
    )
    return state
