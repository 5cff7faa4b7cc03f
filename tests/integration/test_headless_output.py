"""``--no-tui`` says each result once: a stage's measurements are printed as lines only where
they are a curve (train's loss, extract's cache); eval's figures are its table, in the log."""

from __future__ import annotations

import io

from eagleops.headless import _print_loop
from eagleops.pipeline.protocol.events import LogEvent, StageMetrics


class _Engine:
    def __init__(self, events):
        self.events = events

    def subscribe(self):
        async def iterate():
            for event in self.events:
                yield event

        return iterate()


async def test_eval_and_prepare_figures_are_not_printed_twice():
    events = [
        StageMetrics("prepare", {"samples": 563}),
        LogEvent("info", "prepare: 563 samples, 34234 tokens"),
        StageMetrics("train", {"step": 10, "loss": 3.2}),
        StageMetrics("eval", {"acceptance_length": 2.77, "verify_steps": 342}),
        LogEvent("info", "eval: benchmark   n  steps  accept"),
        LogEvent("info", "eval: held-out   20    342    2.77"),
    ]
    out = io.StringIO()
    await _print_loop(_Engine(events), out, as_json=False, every_s=1.0)  # type: ignore[arg-type]
    text = out.getvalue()
    assert "METRICS train: step 10" in text
    assert "METRICS eval" not in text and "METRICS prepare" not in text
    assert text.count("2.77") == 1 and text.count("563 samples") == 1
