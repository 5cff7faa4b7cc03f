"""``--no-tui``: the engine with its events printed as status lines or JSON lines (the same
events the console renders, in the same words: ``console.report``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable
from typing import TextIO

from eagleops.console.report import STATUS_WIDTH, format_event, json_line, status_line, totals_line
from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.errors import ExitCode
from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, StageMetrics, StageProgress

# stages whose measurements are a curve worth a line each (train's loss, extract's cache); the
# others log their result in a line of their own
CURVES = ("train", "extract")

__all__ = ["install_kill_signals", "run_headless"]


def install_kill_signals(engine: Engine) -> None:
    """First Ctrl-C/SIGTERM kills cleanly (finished work kept); a second one exits at once."""
    loop = asyncio.get_running_loop()
    hits = 0

    def on_signal() -> None:
        nonlocal hits
        hits += 1
        if hits > 1:
            os._exit(ExitCode.KILLED)  # the manifest is always consistent on disk; nothing to save
        engine.kill()

    def on_hangup() -> None:  # the terminal went (an SSH drop): the run goes on, its output nowhere
        for stream in (sys.stdout, sys.stderr):
            _silence(stream)
        engine.log("warning", "terminal hung up; the run goes on (eagleops attach / status / kill)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, on_hangup)


async def _print_events(engine: Engine, out: TextIO, as_json: bool, every_s: float) -> None:
    """Print until the run ends; a reader that goes away (``| head``) stops the printing, not the run."""
    try:
        await _print_loop(engine, out, as_json, every_s)
    except BrokenPipeError:
        _silence(out)


def _silence(out: TextIO) -> None:
    """Point ``out`` at /dev/null, so later writes and the interpreter's exit flush succeed."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)


def _wrapped(line: str, width: int = 100) -> str:
    """A long log line on several lines within ``width``, continued under its message."""
    if len(line) <= width:
        return line
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=" " * 17, break_on_hyphens=False))


async def _print_loop(engine: Engine, out: TextIO, as_json: bool, every_s: float) -> None:
    """JSON: every event. Lines: a dataset when its state changes, else at most every ``every_s``
    and only if something in it changed (a finished dataset is not reprinted); each line
    timestamped and within 100 columns."""
    latest: dict[str, DatasetProgress] = {}
    printed: dict[str, tuple[str, DatasetState, float]] = {}  # name -> (line, state, when)
    last_stage_print = 0.0
    async for event in engine.subscribe():
        if as_json:
            out.write(json_line(event) + "\n")
            out.flush()
            continue
        if isinstance(event, DatasetProgress):
            latest[event.name] = event
            line, now = status_line(event), time.monotonic()
            before = printed.get(event.name)
            if before is None or before[1] != event.state or (line != before[0] and now - before[2] >= every_s):
                printed[event.name] = (line, event.state, now)
                out.write(f"{format_event(event)}\n")
                out.flush()
        elif isinstance(event, StageProgress):
            if time.monotonic() - last_stage_print >= every_s or event.done >= event.total:
                last_stage_print = time.monotonic()
                out.write(f"{format_event(event)}\n")
                out.flush()
        elif isinstance(event, StageMetrics) and event.stage not in CURVES:
            continue  # the stage's own log line says it once (--json has every figure)
        elif (text := format_event(event)) is not None and event.kind != "endpoint":
            out.write(_wrapped(text) + "\n")
            out.flush()
    if latest:
        out.write("summary:\n")
        for progress in latest.values():
            out.write(f"  {status_line(progress, STATUS_WIDTH + 7)}\n")
        out.write(f"  {totals_line(list(latest.values()), STATUS_WIDTH + 7)}\n")
        out.flush()


async def run_headless(
    config: RunConfig,
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    serve_socket: bool = True,
    stages: tuple[str, ...] | None = None,
    hung_up: Callable[[], bool] = lambda: False,
) -> int:
    """``hung_up``: whether the terminal went before this took the signals over (the command
    line holds them from its first millisecond)."""
    out = out or sys.stdout
    engine = Engine(config, stages=stages)
    await engine.open()
    server = await engine.serve_socket() if serve_socket else None
    install_kill_signals(engine)
    if hung_up():
        engine.log("warning", "terminal hung up; the run goes on (eagleops attach / status / kill)")
    printer = asyncio.create_task(_print_events(engine, out, as_json, config.status_interval_s), name="printer")
    try:
        summary = await engine.run()
    finally:
        if server is not None:
            await server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(printer, 5)
    return summary.exit_code
