"""The ML stages live: prepare, extract, train, export and eval run for hours or days, so while one
runs it takes the datasets table's place with what an operator watches: progress, rate and ETA;
for train the loss over steps, the accuracy at each draft position, steps/s, tokens/s, the
learning rate and the last checkpoint; for extract tokens/s and the feature cache against its
bound; every GPU's memory where NVML has it."""

from __future__ import annotations

import time
from collections.abc import Callable

from eagleops.console.report import (
    format_bytes,
    format_duration,
    format_rate,
    format_tokens,
    join_fitting,
    plot,
    progress_bar,
    sparkline,
)
from eagleops.pipeline.protocol.events import StageStatus
from eagleops.pipeline.stages import COMPUTE_STAGES

from ..state import ConsoleState
from .text import TextPane

__all__ = ["TrainingView", "running_compute_stage", "training_lines"]


def running_compute_stage(state: ConsoleState) -> str | None:
    """The ML stage running (or paused) now; with several (extract beside train), train."""
    live = [s for s in COMPUTE_STAGES if (st := state.stages.get(s)) is not None and st.status in (StageStatus.RUNNING, StageStatus.PAUSED)]
    return "train" if "train" in live else (live[0] if live else None)


def _ago(at: float | None, now: float) -> str:
    return "" if at is None else f" ({format_duration(max(0.0, now - at))} ago)"


def _progress_line(state: ConsoleState, stage: str, width: int) -> str:
    """The stage, its bar and numbers, as many as fit in ``width`` (whole, never cut)."""
    status = state.stages[stage].status
    progress = state.stage_progress.get(stage)
    head = f"{stage} paused" if status == StageStatus.PAUSED else stage
    if progress is None or not progress.total:
        return f"{stage}  {status.value}"
    fraction, unit = progress.done / progress.total, progress.unit
    pieces = [
        f"{progress_bar(fraction, max(8, min(24, width // 5)))} {100 * fraction:5.1f}%",
        f"{format_tokens(progress.done)}/{format_tokens(progress.total)} {unit}",
    ]
    if status != StageStatus.PAUSED:  # paused, it makes no progress: no rate, no ETA
        pieces += [f"ETA {format_duration(progress.eta_s)}", f"{format_rate(progress.rate)} {unit}/s"]
    return join_fitting(head, pieces, width)


def _train_lines(state: ConsoleState, width: int, height: int, now: float) -> list[str]:
    train = state.stage_metrics.get("train", {})
    lines = []
    if "loss" in train:
        parts = [f"loss {train['loss']:.3f}", f"lr {train['lr']:.2e}" if "lr" in train else ""]
        if "tokens_per_s" in train:
            parts.append(f"{format_rate(train['tokens_per_s'])} tok/s")
        if "epoch" in train:
            parts.append(f"epoch {train['epoch']}")
        saved = (
            f"saved step {train['checkpoint_step']:,}{_ago(train.get('checkpoint_at'), now)}"
            if "checkpoint_step" in train
            else "no checkpoint yet"
        )
        parts.insert(1, saved)  # after the loss: what a crash would cost
        lines.append(join_fitting("", parts, width))
    acc = train.get("acc") or []
    if acc:  # a block drafter has a position per slot (15 at block 16): as many as fit, from the first
        head = "accuracy by draft position  "  # two spaces, then the figures
        fit = max(1, (width - len(head)) // 5)
        shown = acc if fit >= len(acc) else acc[: max(1, (width - len(head) - 4) // 5)]
        lines.append(head + " ".join(f"{a:.2f}" for a in shown) + (" ..." if len(shown) < len(acc) else ""))
    if "block_acceptance" in train:  # dflash: what verifying its training blocks would accept, bonus token included
        lines.append(f"acceptance per training block {train['block_acceptance']:.2f}")
    history = list(state.train_loss)
    room = height - len(lines)
    if history and room >= 3:  # a plot of the loss over steps, as tall as there is room (up to 8 rows)
        lines.append(f"loss over {len(history)} logged steps: {max(history):.3f} -> {history[-1]:.3f}")
        lines += plot(history, width, min(room - 2 if state.acc_history else room - 1, 8))
    elif history and room >= 1:  # small terminals: the curve in one line
        label = f"loss {max(history):.3f} -> {history[-1]:.3f} "
        lines.append(label + sparkline(history, max(1, width - len(label))))
    if state.acc_history and height - len(lines) >= 1:
        first = [a[0] for a in state.acc_history if a]
        label = f"acc@1 {first[-1]:.2f} " if first else "acc@1 "
        lines.append(label + sparkline(first, max(1, width - len(label)), ceiling=1.0))
    return lines


def _extract_lines(state: ConsoleState) -> list[str]:
    extract = state.stage_metrics.get("extract", {})
    if "cache_bytes" not in extract:
        return []
    bound = extract.get("cache_bound_bytes") or 0
    line = f"feature cache {format_bytes(extract['cache_bytes'])}"
    line += f" of {format_bytes(bound)} (max_cache_gb)" if bound else " on disk"
    return [line + f"  {extract.get('shards', 0)} shards"]


def _gpu_memory(state: ConsoleState) -> list[str]:
    if state.gpu is None or not state.gpu.gpus:
        return []
    parts = [f"GPU{index} {format_bytes(used)}/{format_bytes(total)}" for index, _, _, used, total, _, _ in state.gpu.gpus]
    return ["  ".join(parts)]


def training_lines(state: ConsoleState, width: int, height: int, *, now: float | None = None) -> list[str]:
    """What the view shows, at most ``height`` lines of ``width``: the running stage first."""
    now = time.time() if now is None else now
    stage = running_compute_stage(state)
    lines: list[str] = []
    if stage is not None and state.engine_gone:
        lines.append("engine gone: its last figures, not live")
    if stage is not None:
        lines.append(_progress_line(state, stage, width))
        if "extract" in state.stages and state.stages["extract"].status in (StageStatus.RUNNING, StageStatus.PAUSED) and stage == "train":
            lines.append(_progress_line(state, "extract", width))  # captured beside train (overlap_extract)
        lines += _extract_lines(state) if stage in ("extract", "train") else []
        lines += _gpu_memory(state)
        if stage == "train":
            lines += _train_lines(state, width, height - len(lines) - 1, now)
    done = [
        f"{s} {state.stages[s].status.value}" for s in COMPUTE_STAGES if s in state.stages and state.stages[s].status != StageStatus.SKIPPED
    ]
    if done:
        lines.append("  ".join(done))
    return lines[:height]


class TrainingView(TextPane):
    """Takes the datasets table's place while an ML stage runs."""

    def __init__(self, clock: Callable[[], float] = time.time, **kwargs):
        super().__init__("ML stages", **kwargs)
        self.clock = clock

    def render_state(self, state: ConsoleState) -> None:
        width, height = max(20, self.content_region.width), max(1, self.content_region.height)
        self.show_text("\n".join(training_lines(state, width, height, now=self.clock())))
