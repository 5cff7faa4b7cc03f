"""What our loopback servers share: start on 127.0.0.1, report the port, notice disconnects."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from aiohttp import web

__all__ = ["client_gone", "serve_forever", "wait_unless_disconnected"]

LOOPBACK = "127.0.0.1"


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_unless_disconnected(request: web.Request, awaitable, poll_s: float = 0.02):
    """Await ``awaitable`` unless the client hangs up first (then return None and cancel it).

    aiohttp no longer cancels handlers when a client disconnects, so we watch the transport.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if client_gone(request):
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()


async def _run(app: web.Application, host: str, port: int, port_file: Path | None) -> None:
    if host not in (LOOPBACK, "localhost", "::1"):
        raise SystemExit(f"refusing to listen on {host}: these servers are for loopback only")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    actual = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(actual))
        os.replace(tmp, port_file)
    print(f"listening on http://{host}:{actual}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def serve_forever(app: web.Application, host: str, port: int, port_file: str | None) -> None:
    asyncio.run(_run(app, host, port, Path(port_file) if port_file else None))
