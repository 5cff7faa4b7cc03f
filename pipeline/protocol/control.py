"""The engine's command API on a local Unix socket (mode 0600), one JSON object per line.

Requests: ``{"cmd": "pause"|"resume"|"kill"|"budget", "dataset": ..., "tokens": ...}`` -> an
Ack; ``{"cmd": "status"}`` -> ``{"ok": true, "events": [...]}`` (the current snapshot);
``{"cmd": "detail", "dataset": ...}`` -> ``{"ok": true, "detail": {...}}`` (failures by reason,
latency, endpoints); ``{"cmd": "subscribe"}`` -> the snapshot, then every event as it happens, until either side
closes. A TUI attaches with ``subscribe`` on one connection and sends commands on another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.protocol.events import Ack, Command, Event, command_from_json, event_from_json

__all__ = [
    "ControlClient",
    "ControlError",
    "ControlServer",
    "Controllable",
    "checked_runtime_dir",
    "find_sockets",
    "runtime_dir",
    "socket_path_for",
]

_DRAIN_S = 1.0  # at most, for attached consoles to read what the engine said last
_LIMIT = 1 << 20  # one request line; a longer one is answered with an error and the connection closed
_BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)


class ControlError(RunError):
    """No engine answers on the socket, or the socket cannot be served."""


def runtime_dir() -> Path:
    # Not $XDG_RUNTIME_DIR: logind removes it when the last SSH session ends, and a detached
    # engine outlives its terminal.
    base = os.environ.get("EAGLEOPS_RUNTIME_DIR") or f"/tmp/eagleops-{os.getuid()}"
    return Path(base)


def checked_runtime_dir(*, create: bool) -> Path:
    """The runtime dir, refused (as OpenSSH refuses its dirs) unless it is a real directory,
    owned by us and closed to everyone else: in a shared /tmp anyone can create it first."""
    folder = runtime_dir()
    if create:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ControlError(f"{folder}: cannot create the runtime directory ({exc.strerror or exc})") from None
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        if create:
            raise ControlError(f"{folder}: could not be created") from None
        return folder
    fix = "remove it, or set EAGLEOPS_RUNTIME_DIR to a directory of your own"
    if stat.S_ISLNK(info.st_mode):
        raise ControlError(f"{folder}: is a symbolic link; refusing it ({fix})")
    if not stat.S_ISDIR(info.st_mode):
        raise ControlError(f"{folder}: is not a directory; refusing it ({fix})")
    if info.st_uid != os.getuid():
        raise ControlError(f"{folder}: owned by uid {info.st_uid}, not by us (uid {os.getuid()}); refusing it ({fix})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ControlError(f"{folder}: mode {stat.S_IMODE(info.st_mode):04o}, open to others; refusing it (chmod 700 it if it is yours)")
    return folder


def _check_socket(path: Path) -> None:
    """A socket we talk to is ours: a fake one answering for an engine would steer our commands."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return  # the connect says so
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise ControlError(f"{path}: not a socket of ours (owner uid {info.st_uid}); refusing to talk to it")


def socket_path_for(run_name: str, output_dir: Path) -> Path:
    # Unix socket paths are capped near 108 bytes, so the socket lives in a short runtime dir
    # under a name derived from the output dir (the same run always gets the same socket).
    digest = hashlib.blake2b(str(output_dir.resolve()).encode(), digest_size=4).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name)[:40]
    return runtime_dir() / f"{safe}-{digest}.sock"


def _is_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def find_sockets() -> list[Path]:
    """Sockets of engines that answer, newest first."""
    folder = checked_runtime_dir(create=False)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("*.sock") if p.is_socket() and p.lstat().st_uid == os.getuid() and _is_live(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


class EventStream(Protocol):
    def __aiter__(self) -> AsyncIterator[Event]: ...

    def close(self) -> None: ...


class Controllable(Protocol):
    """What the socket serves: an engine's snapshot, its event stream and its commands."""

    def snapshot(self) -> list[Event]: ...

    def subscribe(self) -> EventStream: ...

    async def execute(self, command: Command) -> Ack: ...

    async def detail(self, name: str) -> dict[str, Any]: ...


class ControlServer:
    def __init__(self, engine: Controllable, path: Path):
        self.engine, self.path = engine, path
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.path.parent == runtime_dir():
            checked_runtime_dir(create=True)
        else:  # a socket path of the caller's choosing: its folder is its business, created private
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _is_live(self.path):
                raise ControlError(f"{self.path}: another engine is already serving this run")
            self.path.unlink()
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=_LIMIT, backlog=_BACKLOG)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            if self._streams:  # an ended engine's last events (why it exits as it does) reach its consoles
                await asyncio.wait(list(self._streams), timeout=_DRAIN_S)
            for task in list(self._streams):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # always, inside a server callback; the check is for the type
            self._streams.add(task)
        try:
            while line := await _read_request(reader, writer):
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("expected a JSON object")
                except ValueError as exc:
                    await _send(writer, {"ok": False, "message": f"bad request: {exc}"})
                    continue
                name = request.get("cmd")
                if name == "subscribe":
                    await self._stream(writer)
                    return
                if name == "status":
                    await _send(writer, {"ok": True, "events": [e.to_json() for e in self.engine.snapshot()]})
                    continue
                if name == "detail":
                    try:
                        answer = await self.engine.detail(str(request.get("dataset")))
                    except Exception as exc:  # one failed request, not a traceback in the server
                        answer = {"ok": False, "message": f"detail failed: {type(exc).__name__}: {exc}"}
                    await _send(writer, answer)
                    continue
                try:
                    command = command_from_json(request)
                except ValueError as exc:
                    await _send(writer, {"ok": False, "message": str(exc)})
                    continue
                ack = await self.engine.execute(command)
                await _send(writer, ack.to_json())
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # our own close() ending a connection: Python 3.11's server callback would report a
            # cancelled handler as an error ("Exception in callback ... CancelledError")
            pass
        finally:
            if task is not None:
                self._streams.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        subscription = self.engine.subscribe()
        try:
            async for event in subscription:
                writer.write(_encode(event.to_json()))
                await writer.drain()
        finally:
            subscription.close()


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """The next request line; b"" at the end, or after answering a line over the limit."""
    try:
        return await reader.readline()
    except ValueError:  # the line ran past _LIMIT: what is left of it cannot be resynchronised
        await _send(writer, {"ok": False, "message": f"request line over {_LIMIT} bytes; connection closed"})
        return b""


def _encode(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":")) + "\n").encode()


async def _send(writer: asyncio.StreamWriter, payload: dict[str, Any]) -> None:
    writer.write(_encode(payload))
    await writer.drain()


class ControlClient:
    """Talks to a running engine: one request/answer connection, plus ``events()`` streams."""

    def __init__(self, path: Path):
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.path.parent == runtime_dir():
            checked_runtime_dir(create=False)
        _check_socket(self.path)
        try:
            return await asyncio.open_unix_connection(str(self.path), limit=_LIMIT)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlError(f"{self.path}: no engine answers ({exc.strerror or exc})") from None

    async def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            if self._writer is None or self._reader is None:
                self._reader, self._writer = await self._connect()
            self._writer.write(_encode(payload))
            await self._writer.drain()
            line = await self._reader.readline()
            if not line:
                self._writer = None
                raise ControlError(f"{self.path}: the engine closed the connection")
            return json.loads(line)

    async def send(self, command: Command) -> Ack:
        answer = await self.request(command.to_json())
        return Ack(bool(answer.get("ok")), str(answer.get("message", "")))

    async def detail(self, name: str) -> dict[str, Any]:
        answer = await self.request({"cmd": "detail", "dataset": name})
        if not answer.get("ok"):
            raise ControlError(str(answer.get("message", "no detail")))
        return dict(answer["detail"])

    async def status(self) -> list[Event]:
        answer = await self.request({"cmd": "status"})
        return [event_from_json(e) for e in answer.get("events", [])]

    async def events(self) -> AsyncIterator[Event]:
        reader, writer = await self._connect()
        try:
            writer.write(_encode({"cmd": "subscribe"}))
            await writer.drain()
            while line := await reader.readline():
                yield event_from_json(json.loads(line))
        finally:
            writer.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None
