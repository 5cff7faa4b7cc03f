"""``--no-tui``: the engine with its events printed as status lines or JSON lines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import TextIO

from pipeline.config import RunConfig
from pipeline.engine import Engine, RunSummary
from pipeline.protocol.events import DatasetProgress, DatasetState, StageProgress
from pipeline.protocol.report import format_event, json_line, status_line

__all__ = ["exit_code", "run_headless", "install_kill_signals"]

EXIT_OK, EXIT_FAILED, EXIT_KILLED = 0, 1, 130


def exit_code(summary: RunSummary) -> int:
    if summary.killed:
        return EXIT_KILLED
    return EXIT_OK if summary.ok else EXIT_FAILED


def install_kill_signals(engine: Engine) -> None:
    """First Ctrl-C/SIGTERM kills cleanly (finished work kept); a second one exits at once."""
    loop = asyncio.get_running_loop()
    hits = 0

    def on_signal() -> None:
        nonlocal hits
        hits += 1
        if hits > 1:
            os._exit(EXIT_KILLED)  # the manifest is always consistent on disk; nothing to save
        engine.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)


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


async def _print_loop(engine: Engine, out: TextIO, as_json: bool, every_s: float) -> None:
    latest: dict[str, DatasetProgress] = {}
    last_states: dict[str, DatasetState] = {}
    last_print = time.monotonic()
    last_stage_print = 0.0
    async for event in engine.subscribe():
        if as_json:
            out.write(json_line(event) + "\n")
            out.flush()
            continue
        if isinstance(event, DatasetProgress):
            latest[event.name] = event
            if last_states.get(event.name) != event.state:
                last_states[event.name] = event.state
                out.write(format_event(event) + "\n")
            if time.monotonic() - last_print >= every_s:
                last_print = time.monotonic()
                for progress in latest.values():
                    out.write(status_line(progress) + "\n")
                out.flush()
        elif isinstance(event, StageProgress):
            if time.monotonic() - last_stage_print >= every_s or event.done >= event.total:
                last_stage_print = time.monotonic()
                out.write(format_event(event) + "\n")
                out.flush()
        elif (line := format_event(event)) is not None and event.kind != "endpoint":
            out.write(line + "\n")
            out.flush()
    if not as_json and latest:
        out.write("summary:\n")
        for progress in latest.values():
            out.write("  " + status_line(progress) + "\n")
        out.flush()


async def run_headless(
    config: RunConfig, *, as_json: bool = False, out: TextIO | None = None, serve_socket: bool = True, stages: tuple[str, ...] | None = None
) -> int:
    out = out or sys.stdout
    engine = Engine(config, stages=stages)
    await engine.open()
    server = await engine.serve_socket() if serve_socket else None
    install_kill_signals(engine)
    printer = asyncio.create_task(_print_events(engine, out, as_json, config.status_interval_s), name="printer")
    try:
        summary = await engine.run()
    finally:
        if server is not None:
            await server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(printer, 5)
    return exit_code(summary)
