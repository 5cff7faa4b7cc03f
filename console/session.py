"""A console session: the engine in this process with the console over it, or the console
attached to an engine elsewhere; what it last showed is left in the terminal when it closes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from eagleops.console.report import status_line, totals_line
from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.engine import Engine, RunSummary
from eagleops.pipeline.protocol.control import ControlError
from eagleops.pipeline.protocol.events import Ack, Command, Event

from .app import EagleOpsApp
from .link import SocketLink

__all__ = ["LocalLink", "attach_console", "print_summary", "run_console"]


class LocalLink:
    """The engine runs as a task of the console's own event loop."""

    attached = False

    def __init__(self, engine: Engine):
        self.engine = engine
        self.description = f"run {engine.config.name}"
        self.task: asyncio.Task[RunSummary] | None = None
        self._subscription = engine.subscribe()

    async def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.engine.run(), name="engine")

    def events(self) -> AsyncIterator[Event]:
        return aiter(self._subscription)

    async def send(self, command: Command) -> Ack:
        return await self.engine.execute(command)

    async def detail(self, name: str) -> dict[str, Any]:
        answer = await self.engine.detail(name)
        if not answer.get("ok"):
            raise ControlError(str(answer.get("message")))
        return answer["detail"]

    async def stop(self) -> None:
        """Quit = kill: in-flight requests cancelled, finished work kept, resumable."""
        self.engine.kill()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @property
    def summary(self) -> RunSummary | None:
        if self.task is not None and self.task.done() and not self.task.cancelled():
            return self.task.result()
        return None

    def exit_code(self) -> int | None:
        summary = self.summary
        return summary.exit_code if summary is not None else None


async def run_console(config: RunConfig, *, theme: str = "dark", refresh_s: float = 1.0, stages: tuple[str, ...] | None = None) -> int:
    """``eagleops run`` with the TUI: engine and console in one event loop, socket served too."""
    engine = Engine(config, stages=stages)
    await engine.open()
    server = await engine.serve_socket()
    link = LocalLink(engine)
    app = EagleOpsApp(link, theme=theme, refresh_s=refresh_s)
    try:
        code = await app.run_async()
    finally:
        await link.stop()  # also when the terminal went away: kill cleanly, keep the work
        if server is not None:
            await server.close()
    print_summary(app)
    return code if code is not None else link.exit_code() or 0


async def attach_console(path: Path, *, theme: str = "dark", refresh_s: float = 1.0) -> int:
    app = EagleOpsApp(SocketLink(path), theme=theme, refresh_s=refresh_s)
    code = await app.run_async()
    print_summary(app)
    return code or 0


def print_summary(app: EagleOpsApp) -> None:
    """What the console last showed, left in the terminal after it closes (as --no-tui ends)."""
    datasets = list(app.state.datasets.values())
    if not datasets:
        return
    with contextlib.suppress(OSError):  # the terminal may be gone (a hangup)
        print("\n".join(["summary:", *(f"  {status_line(p)}" for p in datasets), f"  {totals_line(datasets)}"]), flush=True)
