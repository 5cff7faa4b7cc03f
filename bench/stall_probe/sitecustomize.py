"""Where does a request wait? Timestamps of each hop, in every Python process started with this
folder on ``PYTHONPATH`` and ``STALL_PROBE_DIR`` set (issue 24; a diagnosis tool, never shipped):

- the client (aiohttp): ``c_req`` a request is asked for, ``c_send`` it has a connection,
  ``c_write`` its bytes left through the socket (local port), ``c_recv`` reply bytes arrived;
- vLLM's API process (uvicorn/httptools): ``recv`` bytes read from a connection (peer port),
  ``parsed`` a request is whole, ``chat`` the handler starts, ``add`` it goes to AsyncLLM,
  ``send`` to the engine core, ``responded`` the reply is written;
- the engine core: ``core_add`` a request arrives, ``step`` a step that took over 0.5 ms.

One line per event, ``<monotonic s> <pid> <event> <key>``, in ``$STALL_PROBE_DIR/<pid>.log``
(CLOCK_MONOTONIC is one clock for every process of the machine). ``timeline.py`` lines them up.

    PYTHONPATH=bench/stall_probe STALL_PROBE_DIR=/tmp/probe python bench/generate_stalls.py ...

The patches wrap methods after their module is imported, so an upgrade of vLLM, uvicorn or
aiohttp that renames one makes the probe log ``patch_error`` for it and carry on unpatched.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("STALL_PROBE_DIR")
_files: dict[int, Any] = {}


def _log(event: str, key: object = "") -> None:
    pid = os.getpid()  # per call: a forked child writes its own file
    out = _files.get(pid)
    if out is None:
        out = _files[pid] = open(os.path.join(_DIR or ".", f"{pid}.log"), "a", buffering=1)
    out.write(f"{time.monotonic():.6f} {pid} {event} {key}\n")


def _wrap(owner: type, name: str, event: str, key: Any = lambda args: "") -> None:
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            _log(event, key(args))
            return await original(*args, **kwargs)

        setattr(owner, name, wrapped_async)
    else:

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _log(event, key(args))
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)


def _port(transport: Any) -> int:
    try:
        return transport.get_extra_info("sockname")[1]
    except Exception:  # a closed transport
        return 0


def _peer(protocol: Any) -> int:
    return (protocol.client or ("", 0))[1]


def _timed_steps(owner: type) -> None:
    original = owner.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        out = original(self, *args, **kwargs)
        took = time.monotonic() - started
        if took > 0.0005:  # the idle loop's empty steps would drown the log
            _log("step", f"{took:.4f}")
        return out

    owner.step = step  # type: ignore[method-assign]


def _selector_writes(owner: type) -> None:
    original = owner.write

    def write(self: Any, data: bytes) -> None:
        original(self, data)
        _log("c_write", f"{_port(self)} {len(data)} {len(self._buffer)}")

    owner.write = write  # type: ignore[method-assign]


def _patch(module: Any) -> None:
    name = module.__name__
    if name == "uvicorn.protocols.http.httptools_impl":
        _wrap(module.HttpToolsProtocol, "data_received", "recv", lambda a: f"{_peer(a[0])} {len(a[1])}")
        _wrap(module.HttpToolsProtocol, "on_message_complete", "parsed", lambda a: _peer(a[0]))
        _wrap(module.HttpToolsProtocol, "on_response_complete", "responded", lambda a: _peer(a[0]))
    elif name == "vllm.entrypoints.openai.chat_completion.serving":
        _wrap(module.OpenAIServingChat, "create_chat_completion", "chat")
    elif name == "vllm.v1.engine.async_llm":
        _wrap(module.AsyncLLM, "add_request", "add", lambda a: a[1] if len(a) > 1 else "")
    elif name == "vllm.v1.engine.core_client":
        _wrap(module.AsyncMPClient, "add_request_async", "send", lambda a: a[1].request_id)
    elif name == "vllm.v1.engine.core":
        _wrap(module.EngineCore, "add_request", "core_add", lambda a: a[1].request_id)
        _timed_steps(module.EngineCore)
    elif name == "aiohttp.client":
        _wrap(module.ClientSession, "_request", "c_req")
    elif name == "aiohttp.client_reqrep":
        _wrap(module.ClientRequest, "send", "c_send")
    elif name == "aiohttp.client_proto":
        _wrap(module.ResponseHandler, "data_received", "c_recv", lambda a: f"{_port(a[0].transport)} {len(a[1])}")
    elif name == "asyncio.selector_events":
        _selector_writes(module._SelectorSocketTransport)


_MODULES = {
    "uvicorn.protocols.http.httptools_impl",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.core",
    "aiohttp.client",
    "aiohttp.client_reqrep",
    "aiohttp.client_proto",
    "asyncio.selector_events",
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders, then patches the module once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            run = spec.loader.exec_module

            def exec_module(module: Any, run: Any = run) -> None:
                run(module)
                try:
                    _patch(module)
                except Exception as exc:  # a renamed method: log it, run unpatched
                    _log("patch_error", f"{module.__name__}:{exc!r}".replace(" ", "_"))

            spec.loader.exec_module = exec_module
            return spec
        return None


if _DIR:
    sys.meta_path.insert(0, _PatchAfterImport())
