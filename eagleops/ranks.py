"""One rank of a torchrun job (``torchrun --nproc_per_node 8 -m eagleops train RUN.toml``):
under torchrun (``WORLD_SIZE`` > 1) every rank runs the stage itself, with no engine, socket or
lock, and rank 0 prints. Torch is imported only once the stage starts."""

from __future__ import annotations

import contextlib
import os

from eagleops.console.report import format_event
from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import ExitCode

__all__ = ["run_on_every_rank", "under_torchrun"]


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run_on_every_rank(config: RunConfig, stage: str) -> int:
    """This rank's share of a torchrun job: the stage called directly; rank 0's events printed."""
    from eagleops.pipeline.cpus import apply_torch_threads
    from eagleops.pipeline.training.context import StageContext, StageKilled
    from eagleops.pipeline.training.stages import stage_function

    def emit(event) -> None:
        if (line := format_event(event)) is not None:
            print(line, flush=True)

    ctx = StageContext(stage, emit, rank=int(os.environ.get("RANK", "0")))
    # the node's cores shared by its ranks (not measured: the sibling ranks starting now would count as neighbours)
    apply_torch_threads(1 / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))), others=0.0)
    try:
        stage_function(stage)(config, ctx)
    except StageKilled:
        return ExitCode.KILLED
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier()  # every rank past its last collective before the group goes (gloo aborts otherwise)
            dist.destroy_process_group()
    return ExitCode.OK
