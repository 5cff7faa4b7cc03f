"""The run status line at the top: which run, in what state, for how long, how fast, what it
costs and how often it fails, in one row that an operator reads first. Values that are no
longer live (the engine finished or went away) are cleared or marked, never left to look live."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual.geometry import Region
from textual.widget import Widget

from eagleops.console.report import format_duration, format_rate, projected_spend, run_eta_s
from eagleops.pipeline.protocol.events import DatasetState, RunPhase, StageStatus

from ..state import ConsoleState
from ..terminal import to_ascii

__all__ = ["RunStatus", "run_status_text", "run_state_word"]

# failures per minute at which the count turns from a note into a warning, then an alarm
FAILURE_RATE_WARN, FAILURE_RATE_ALARM = 1.0, 30.0


def run_state_word(state: ConsoleState) -> tuple[str, str]:
    """(what the run is doing, its style), trouble in red: the engine's own phase where it said
    one, paused when everything that could run is paused, gone when its link broke."""
    run = state.run
    if state.engine_gone and (run is None or run.phase != RunPhase.FINISHED):
        return "engine gone, figures stale", "bold red"
    if run is None:
        return "connecting", "dim"
    if run.phase == RunPhase.FINISHED:
        code = run.exit_code
        if code == 0:
            return "done", "bold green"
        if code == 130:
            return "killed, resumable (exit 130)", "bold yellow"
        if code == 3:
            return "done, output short (exit 3)", "bold red"
        return f"failed (exit {code})", "bold red"
    if run.phase == RunPhase.STOPPING:
        return "stopping", "bold yellow"
    live = [d for d in state.datasets.values() if not d.state.terminal]
    stage_paused = any(s.status == StageStatus.PAUSED for s in state.stages.values())
    generating = bool(live) and state.stages.get("generate") is not None and state.stages["generate"].status == StageStatus.RUNNING
    if stage_paused or (generating and all(d.state == DatasetState.PAUSED for d in live)):
        return "paused", "bold yellow"
    return "live", "bold green"


def _running_stage(state: ConsoleState) -> str | None:
    for name, stage in state.stages.items():
        if stage.status in (StageStatus.RUNNING, StageStatus.PAUSED):
            return name
    return None


def run_status_text(state: ConsoleState, width: int, *, now: float | None = None, ascii: bool = False) -> Text:
    """The status line in at most ``width`` cells: the most important pieces first, the rest
    while they fit (name, state, stage, elapsed, tok/s, ETA, spend, failures)."""
    now = time.time() if now is None else now
    run = state.run
    finished = state.engine_gone or (run is not None and run.phase == RunPhase.FINISHED)
    word, word_style = run_state_word(state)
    pieces: list[tuple[str, str, str]] = [("program", "eagleops", "bold")]
    if run is not None:
        pieces.append(("name", run.name[:24], "bold"))
    pieces.append(("state", ("* " if ascii else "● ") + word, word_style))
    stage = _running_stage(state)
    datasets = list(state.datasets.values())
    if stage is not None and not finished:
        progress = state.stage_progress.get(stage)
        label = stage
        if stage != "generate" and progress is not None and progress.total:
            label += f" {100 * progress.done / progress.total:.0f}%"
        pieces.append(("stage", label, ""))
    if run is not None:
        ended = run.ended_at if run.ended_at is not None else (state.gone_at if state.engine_gone else None)
        pieces.append(("elapsed", format_duration(max(0.0, (ended or now) - run.started_at)), ""))
    if not finished:
        if stage == "generate" or (stage is None and datasets):
            rate, eta = sum(d.tok_per_s for d in datasets if d.state == DatasetState.RUNNING), run_eta_s(datasets)
            pieces.append(("rate", f"{format_rate(rate)} tok/s", ""))
        else:
            progress = state.stage_progress.get(stage) if stage else None
            paused = stage is not None and state.stages[stage].status == StageStatus.PAUSED
            rate, eta = (progress.rate, progress.eta_s) if progress is not None and not paused else (0.0, None)
            if progress is not None and not paused:
                pieces.append(("rate", f"{format_rate(rate)} {progress.unit}/s", ""))
        if eta is not None:
            pieces.append(("eta", f"ETA {format_duration(eta)}", ""))
    spent = sum(d.cost for d in datasets)
    if spent:
        pieces.append(("spend", f"spend ${spent:.2f}" if finished else f"spend ${spent:.2f}/${projected_spend(datasets):.2f}", ""))
    per_minute = state.failures_per_minute(now)
    if per_minute is not None and per_minute > 0 and not finished:
        style = "bold red" if per_minute >= FAILURE_RATE_ALARM else "yellow" if per_minute >= FAILURE_RATE_WARN else ""
        pieces.append(("failures", f"{per_minute:.0f} fail/min" if per_minute >= 1 else f"{per_minute:.1f} fail/min", style))
    return _fit(pieces, width, ascii)


# what a narrow terminal keeps, first to last: what runs and in what state, then what it costs
# and how it fails, then how far and how fast; the program's own name last
_PRIORITY = ("name", "state", "spend", "failures", "elapsed", "rate", "eta", "stage", "program")


def _fit(pieces: list[tuple[str, str, str]], width: int, ascii: bool) -> Text:
    """The pieces that fit in ``width``, chosen by priority, shown in their own order; the run's
    name and state are cut rather than dropped."""
    separator = "  "
    texts = [(key, to_ascii(piece) if ascii else piece, style) for key, piece, style in pieces]
    chosen: set[int] = set()
    used = 0
    for key in _PRIORITY:  # strictly by priority: once one does not fit, none after it is shown
        found = [(i, piece) for i, (k, piece, _) in enumerate(texts) if k == key]
        if found:
            i, piece = found[0]
            need = len(piece) + (len(separator) if chosen else 0)
            if used + need > width and key not in ("name", "state"):
                break
            chosen.add(i)
            used += need
    text = Text(no_wrap=True, overflow="crop")
    for i, (key, piece, style) in enumerate(texts):
        if i in chosen or key in ("name", "state"):
            if text.cell_len:
                text.append(separator)
            text.append(piece, style)
    text.truncate(width)
    return text


class RunStatus(Widget):
    """One row, docked at the top; repainted only when its text changes."""

    DEFAULT_CSS = """
    RunStatus {
        dock: top;
        height: 1;
        padding: 0 1;
    }
    """

    def __init__(self, clock: Callable[[], float] = time.time, **kwargs):
        super().__init__(**kwargs)
        self.clock = clock
        self._text = Text()

    def render(self) -> Text:
        return self._text

    def render_state(self, state: ConsoleState) -> None:
        text = run_status_text(state, max(1, self.size.width - 2), now=self.clock(), ascii=getattr(self.app, "ascii", False))
        old, new = self._text, text
        if old.plain == new.plain and old.spans == new.spans:
            return
        self._text = text
        if len(old.plain) == len(new.plain) and old.spans == new.spans and self.content_region.width:
            # most seconds only the elapsed time moves: repaint those cells, not the row
            first = next(i for i, (a, b) in enumerate(zip(old.plain, new.plain)) if a != b)
            last = max(i for i, (a, b) in enumerate(zip(old.plain, new.plain)) if a != b)
            self.refresh(Region(first, 0, last - first + 1, 1))
        else:
            self.refresh()
