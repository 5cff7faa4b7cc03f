"""``eagleops run`` with a console: the engine runs detached, the console attaches to it.

As tmux and screen do it: the engine is a headless process in a session of its own, with no
terminal, so an SSH drop (SIGHUP) or closing the console leaves the run going, and
``eagleops attach`` picks it up again. Its output goes to ``OUT/engine.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import RunError
from eagleops.pipeline.protocol.control import ControlClient, checked_runtime_dir, socket_path_for

__all__ = ["DetachedEngine", "start_detached"]

STARTUP_TIMEOUT_S = 120.0


class DetachedEngine:
    def __init__(self, proc: subprocess.Popen | None, socket: Path, log: Path):
        self.proc, self.socket, self.log = proc, socket, log

    def exit_code(self) -> int | None:
        """The engine's exit code once it has ended (only known to the process that started it)."""
        return self.proc.poll() if self.proc is not None else None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _answers(socket: Path) -> bool:
    import asyncio

    async def probe() -> bool:
        client = ControlClient(socket)
        try:
            await client.status()
            return True
        except (RunError, OSError, ValueError):
            return False
        finally:
            await client.close()

    return asyncio.run(probe())


def start_detached(config: RunConfig, argv: list[str]) -> DetachedEngine:
    """Start ``eagleops <argv> --no-tui`` detached, or find the engine already serving this run;
    return once it answers on its socket. Raises RunError with its log's tail if it ends first."""
    checked_runtime_dir(create=True)  # refused here, at once, rather than by a detached engine nobody could reach
    socket = socket_path_for(config.name, config.output_dir)
    log = config.layout.engine_log
    if socket.exists() and _answers(socket):
        return DetachedEngine(None, socket, log)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagleops", *argv, "--no-tui"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no controlling terminal: a hangup of ours is not its
            env={**os.environ, "EAGLEOPS_DETACHED": "1"},
        )
    engine = DetachedEngine(proc, socket, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code == 0:
            return engine  # finished before there was anything to watch (e.g. already at budget)
        if code is not None:
            raise _ended(engine, code)
        if socket.exists() and _answers(socket):
            return engine
        time.sleep(0.1)
    raise RunError(f"the engine (pid {proc.pid}) did not answer on {socket} in {STARTUP_TIMEOUT_S:g}s; see {log}")


def _ended(engine: DetachedEngine, code: int) -> RunError:
    error = RunError(f"the engine ended before the console could attach (exit {code}); {engine.log}:\n{engine.tail()}")
    error.exit_code = code or 1
    return error
