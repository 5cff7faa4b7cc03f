"""The pipeline's stages: status, progress and ETA, the train loss plot, acceptance length."""

from __future__ import annotations

from eagleops.console.report import format_bytes, format_duration, sparkline
from eagleops.pipeline.config.tokens import format_tokens
from eagleops.pipeline.protocol.events import StageStatus
from eagleops.pipeline.stages import STAGE_NAMES

from ..state import ConsoleState
from .text import TextPane

__all__ = ["StagesPane"]


_STAGE_MARK = {
    StageStatus.SKIPPED: " ",
    StageStatus.PENDING: "·",
    StageStatus.RUNNING: "▶",
    StageStatus.PAUSED: "‖",
    StageStatus.DONE: "✓",
    StageStatus.KILLED: "✗",
    StageStatus.FAILED: "✗",
}


class StagesPane(TextPane):
    def __init__(self, **kwargs):
        super().__init__("Stages", **kwargs)

    def render_state(self, state: ConsoleState, width: int = 30) -> None:
        lines = []
        for name in STAGE_NAMES:
            stage = state.stages.get(name)
            status = stage.status if stage else StageStatus.PENDING
            if status == StageStatus.SKIPPED:
                continue  # not in this run: nothing to wait for
            word = "stale" if state.engine_gone and status in (StageStatus.RUNNING, StageStatus.PAUSED) else status.value
            line = f"{_STAGE_MARK[status]} {name:<9} {word:<8}"
            progress = state.stage_progress.get(name)
            if progress is not None and progress.total and status in (StageStatus.RUNNING, StageStatus.PAUSED) and not state.engine_gone:
                line += f" {100 * progress.done / progress.total:5.1f}% ETA {format_duration(progress.eta_s)}"
            lines.append(line)
            if name == "extract" and status == StageStatus.PENDING and (rows := sum(p.captured_rows for p in state.datasets.values())):
                # the serving target captures as it generates (during_generate): what extract need
                # not do, on a line of its own (the pane is 23 columns at 80x24)
                lines.append(f"  {format_tokens(rows)} rows, {format_bytes(sum(p.captured_bytes for p in state.datasets.values()))}")
        train = state.stage_metrics.get("train", {})
        if "loss" in train:
            acc = train.get("acc") or []
            lines.append(f"train step {train.get('step', '?')} loss {train['loss']:.3f}" + (f" acc {acc[0]:.2f}" if acc else ""))
            lines.append(sparkline(list(state.train_loss), width))
        evaluation = state.stage_metrics.get("eval", {})
        if "acceptance_length" in evaluation:
            lines.append(f"acceptance length {evaluation['acceptance_length']:.2f}")
        self.show_text("\n".join(lines))
