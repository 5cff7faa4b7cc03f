"""``python -m pipeline STAGE RUN.toml``: one compute stage without the console, and the entry
point torchrun launches::

    torchrun --nproc_per_node 8 -m pipeline train RUN.toml

Under torchrun (``WORLD_SIZE`` > 1) every rank runs the stage itself, with no engine, socket or
lock, and rank 0 prints. Alone it runs the stage in the engine, headless, as
``eagleops STAGE RUN.toml --no-tui`` does. Torch is imported only once a stage starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

from pipeline.config import RunConfig, load_run
from pipeline.errors import EagleOpsError

__all__ = ["STAGES", "main", "run_on_every_rank"]

STAGES = ("prepare", "extract", "train", "export", "eval")
EXIT_USAGE, EXIT_KILLED = 2, 130


def run_on_every_rank(config: RunConfig, stage: str) -> int:
    """This rank's share of a torchrun job: the stage called directly; rank 0's events printed."""
    from pipeline.protocol.report import format_event
    from pipeline.training.context import StageContext, StageKilled
    from pipeline.training.stages import stage_functions

    def emit(event) -> None:
        if (line := format_event(event)) is not None:
            print(line, flush=True)

    ctx = StageContext(stage, emit, rank=int(os.environ.get("RANK", "0")))
    from pipeline.cpus import apply_torch_threads

    # the node's cores shared by its ranks (not measured: the sibling ranks starting now would count as neighbours)
    apply_torch_threads(1 / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))), others=0.0)
    try:
        stage_functions()[stage](config, ctx)
    except StageKilled:
        return EXIT_KILLED
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier()  # every rank past its last collective before the group goes (gloo aborts otherwise)
            dist.destroy_process_group()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="Run one stage headless; under torchrun, one rank of it (torchrun --nproc_per_node N -m pipeline train RUN.toml).",
    )
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("run_file", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON event per line instead of status lines (without torchrun)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_run(args.run_file)
        if config.target is None:
            print(f"eagleops: {args.run_file}: {args.stage} needs a [target] table naming the target model", file=sys.stderr)
            return EXIT_USAGE
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return run_on_every_rank(config, args.stage)
        from pipeline.engine.headless import run_headless

        return asyncio.run(run_headless(config, as_json=args.json, stages=(args.stage,)))
    except EagleOpsError as exc:
        print(f"eagleops: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_KILLED


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a rank leaves without finalizing the interpreter: gloo's worker threads can still be
        # dropping the last collective's tensors, and one that takes the GIL of a finalizing
        # interpreter aborts the rank ("terminate called without an active exception", SIGABRT,
        # about one exit in 20 here; pytorch/pytorch#179291). Everything is written and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
