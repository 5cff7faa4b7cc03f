"""How the console reaches an engine: in the same event loop, or over its control socket.

The console sees only this interface (events out, commands in), never engine internals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from pipeline.engine import Engine, RunSummary
from pipeline.protocol.control import ControlClient, ControlError
from pipeline.protocol.events import Ack, Command, Event

__all__ = ["EngineLink", "LocalLink", "SocketLink"]


class EngineLink(Protocol):
    attached: bool  # True: quitting the console leaves the run going
    description: str

    def events(self) -> AsyncIterator[Event]: ...

    async def send(self, command: Command) -> Ack: ...

    async def detail(self, name: str) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


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


class SocketLink:
    """An engine in another process (``--no-tui``), through its Unix socket."""

    attached = True

    def __init__(self, path: Path):
        self.path = path
        self.description = f"attached to {path}"
        self.client = ControlClient(path)

    async def start(self) -> None:
        pass

    def events(self) -> AsyncIterator[Event]:
        return self.client.events()

    async def send(self, command: Command) -> Ack:
        return await self.client.send(command)

    async def detail(self, name: str) -> dict[str, Any]:
        return await self.client.detail(name)

    async def stop(self) -> None:
        await self.client.close()  # detach: the engine keeps running
