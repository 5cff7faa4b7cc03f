"""A real drafter's training on a small machine takes tens of seconds a step: its rate reads as
such (not "0.0 steps/s"), a console attached mid-run shows the steps, bar and ETA at once (not
at the next step), and a loss curve of a few logged points spans the pane."""

from __future__ import annotations

import asyncio
import time

from eagleops.console.report import format_rate, plot, stage_progress_line
from eagleops.pipeline.protocol.events import StageMetrics, StageProgress, StageState, StageStatus
from eagleops.pipeline.training.context import StageContext


def test_a_slow_rate_keeps_its_significant_figures():
    assert format_rate(0.048) == "0.048" and format_rate(0.5) == "0.5" and format_rate(0.0) == "0.0"
    assert format_rate(12.34) == "12.3" and format_rate(2500) == "2.5k"
    line = stage_progress_line(StageProgress("train", 31, 40, "steps", rate=0.05, eta_s=180.0))
    assert "0.05 steps/s" in line and "ETA 3m00s" in line


def test_the_stage_context_reports_a_rate_below_a_thousandth(monkeypatch):
    sent: list = []
    ctx = StageContext("train")
    monkeypatch.setattr(ctx, "_send", sent.append)
    clock = iter([1000.0, 3000.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    ctx.progress(1, 10, "steps")
    ctx.progress(2, 10, "steps")  # one step in 2000 s
    assert sent[-1].rate == 0.0005 and sent[-1].eta_s == 16000.0


def test_a_few_logged_losses_span_the_plots_width():
    rows = plot([6.0, 5.0, 4.2, 3.9, 3.1, 2.8], 120, 4)
    assert len(rows[-1]) == 120  # the bottom row: every column has a bar
    assert rows[0].startswith("█" * 20)  # the first point, highest, over its sixth of the width
    assert len(plot([1.0, 2.0], 7, 2)[-1]) == 7


async def test_an_attached_console_gets_each_stages_last_progress_at_once(tmp_path):
    """The snapshot a new subscriber gets holds train's progress, not only its state."""
    from eagleops.pipeline.engine import Engine
    from tests.conftest import make_config, write_jsonl

    source = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hi"}])
    engine = Engine(make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "A", "path": str(source), "token_budget": 10}]))
    engine.publish(StageState("train", StageStatus.RUNNING))
    engine.publish(StageProgress("train", 31, 40, "steps", rate=0.05, eta_s=180.0))
    engine.publish(StageMetrics("train", {"step": 30, "loss": 3.1}))
    subscription = engine.subscribe()
    seen = []
    while not subscription.queue.empty():
        seen.append(await asyncio.wait_for(subscription.queue.get(), 1))
    subscription.close()
    progress = [e for e in seen if isinstance(e, StageProgress)]
    assert progress and progress[-1].done == 31 and progress[-1].eta_s == 180.0


def test_the_ml_view_from_a_snapshot_shows_steps_bar_rate_and_eta():
    from eagleops.console.panes.training import training_lines
    from eagleops.console.state import ConsoleState

    state = ConsoleState()
    for event in (
        StageState("train", StageStatus.RUNNING),
        StageProgress("train", 31, 40, "steps", rate=0.05, eta_s=127.0),
        *(StageMetrics("train", {"step": s * 5, "loss": 6.0 / s, "lr": 1e-3}) for s in range(1, 7)),
    ):
        state.apply(event)
    lines = training_lines(state, 120, 14, now=0.0)
    assert "31/40 steps" in lines[0] and "ETA 2m07s" in lines[0] and "0.05 steps/s" in lines[0]
    plot_rows = [line for line in lines if line and set(line) <= set(" ▁▂▃▄▅▆▇█")]
    assert plot_rows and max(len(row) for row in plot_rows) > 100  # not 6 columns of 120
