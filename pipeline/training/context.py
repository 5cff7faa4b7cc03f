"""How a compute stage (prepare, extract, train, export, eval) talks to the engine.

The stage body is plain blocking torch code running in a worker thread; it calls
``ctx.checkpoint()`` between units of work, which blocks while the stage is paused and raises
``StageKilled`` once it is killed, and reports through ``ctx.progress``/``ctx.metrics``/``ctx.log``,
which hand events to the event loop thread-safely. The same context runs with no engine at all
(tests, torchrun workers) and then just records.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from eagleops.pipeline.protocol.events import Event, LogEvent, StageMetrics, StageProgress
from eagleops.pipeline.servers.supervisor import ServerFailed, SupervisedServer

__all__ = ["StageContext", "StageKilled", "serving"]


class StageKilled(Exception):
    """Raised inside a stage at its next checkpoint after a kill: its work so far is kept."""


class StageContext:
    def __init__(self, stage: str, emit: Callable[[Event], object] | None = None, *, rank: int = 0):
        self.stage = stage
        self._emit = emit
        self.rank = rank
        self._running = threading.Event()
        self._running.set()
        self._killed = threading.Event()
        self._on_kill: list[Callable[[], None]] = []
        # set when the stage running beside this one has finished (a train beside its extract):
        # an extract waiting for that train to free room stops waiting
        self.partner_done = threading.Event()
        self.metrics_log: list[dict[str, Any]] = []
        self.logs: list[tuple[str, str]] = []
        self._started = time.monotonic()
        self.started_at = time.time()  # wall clock: compared with files' mtimes
        self._last_progress = 0.0
        self._paused_s = 0.0  # time spent paused: no work, so not in the rate
        self._baseline: tuple[float, float, float] | None = (
            None  # (done, at) at the first report: a resume's earlier work is not this run's rate
        )

    # ---- control (any thread) -----------------------------------------------------------------
    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def kill(self) -> None:
        self._killed.set()
        self._running.set()
        for hook in list(self._on_kill):  # e.g. stop a server still loading: a kill must not wait for it
            threading.Thread(target=hook, name=f"kill-{self.stage}", daemon=True).start()

    def on_kill(self, hook: Callable[[], None]) -> None:
        self._on_kill.append(hook)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def killed(self) -> bool:
        return self._killed.is_set()

    # ---- inside the stage ---------------------------------------------------------------------
    def checkpoint(self) -> None:
        if not self._running.is_set():
            self.log("info", f"{self.stage}: paused")
            paused_at = time.monotonic()
            self._running.wait()
            self._paused_s += time.monotonic() - paused_at
            if not self._killed.is_set():
                self.log("info", f"{self.stage}: resumed")
        if self._killed.is_set():
            raise StageKilled(self.stage)

    def _send(self, event: Event) -> None:
        if self._emit is not None and self.rank == 0:
            self._emit(event)

    def log(self, level: str, message: str) -> None:
        self.logs.append((level, message))
        self._send(LogEvent(level, message, None))

    def progress(self, done: float, total: float, unit: str, *, force: bool = False, **extra: float) -> None:
        """Throttled to ~4 Hz: a stage may call this every batch."""
        now = time.monotonic()
        if not force and now - self._last_progress < 0.25 and done < total:
            return
        self._last_progress = now
        if self._baseline is None:
            self._baseline = (done, now, self._paused_s)
        first_done, first_at, paused_before = self._baseline
        working = now - first_at - (self._paused_s - paused_before)  # a pause is not slow work
        rate = (done - first_done) / working if working > 0 else 0.0
        eta = (total - done) / rate if rate > 0 and total > done else None
        rate = float(f"{rate:.4g}")  # significant figures: a 20 s step is 0.05 steps/s, not 0.0
        self._send(StageProgress(self.stage, done, total, unit, rate, round(eta, 1) if eta is not None else None, dict(extra)))

    def metrics(self, **values: Any) -> None:
        self.metrics_log.append(values)
        self._send(StageMetrics(self.stage, dict(values)))


@contextlib.contextmanager
def serving(server: SupervisedServer, ctx: StageContext) -> Iterator[SupervisedServer]:
    """A server for the length of a stage's work: a kill stops it even while it loads (then the
    stage ends killed, not failed), and it is stopped however the work ends."""
    ctx.on_kill(server.stop)
    try:
        with server:
            yield server
    except ServerFailed:
        if ctx.killed:
            raise StageKilled(ctx.stage) from None
        raise
