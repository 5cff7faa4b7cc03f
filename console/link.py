"""How the console reaches an engine: this interface (events out, commands in), never engine
internals. Over the control socket here; in the same event loop, ``eagleops.console.session.LocalLink``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from eagleops.pipeline.protocol.control import ControlClient
from eagleops.pipeline.protocol.events import Ack, Command, Event

__all__ = ["EngineLink", "SocketLink"]


class EngineLink(Protocol):
    attached: bool  # True: quitting the console leaves the run going
    description: str

    def events(self) -> AsyncIterator[Event]: ...

    async def send(self, command: Command) -> Ack: ...

    async def detail(self, name: str) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def exit_code(self) -> int | None:
        """The run's exit code once it has ended here; None while it runs, or when it runs elsewhere."""


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

    def exit_code(self) -> int | None:
        return None  # the engine's own process knows it
