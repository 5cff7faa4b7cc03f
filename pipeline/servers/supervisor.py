"""A server process we start, watch and stop: vLLM for the target, or any of our own.

It runs in its own process group on a free port of 127.0.0.1, under a tether that ends the group
when eagleops dies, however it dies (``tether.py``); the group is recorded next to the log, so
that the next start there stops what a dead engine left running (``groups.py``). ``start``
returns once ``/health`` answers; a watcher thread restarts it with exponential backoff if it
dies (its whole group ended first), and gives up after ``max_restarts``. Its output goes to a
log file, and its warnings and errors (and every restart) to the ``log`` callback, which an
engine turns into events. Given ``cpus``, it runs on those cores and eagleops keeps to its other
cores until it stops (``eagleops.pipeline.placement.CoresApart``). Everything here is blocking: call it
from a thread (the engine does, through ``asyncio.to_thread``).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from eagleops.pipeline.errors import ConfigError, RunError
from eagleops.pipeline.placement import CoresApart, cpu_list
from eagleops.pipeline.servers.groups import ServerRecord, stop_group, stop_leftovers
from eagleops.pipeline.servers.tether import tethered

__all__ = ["LOOPBACK", "ServerFailed", "SupervisedServer", "checked_python", "free_port", "stop_group"]

LOOPBACK = "127.0.0.1"
Log = Callable[[str, str], object]  # (level, message); what it returns is ignored


class ServerFailed(RunError):
    """The server did not come up, or died more often than it may be restarted."""


def checked_python(python: str, missing: str, where: str) -> str:
    """A server's python as configured: ``missing`` says how to name one, ``where`` whose it is."""
    if not python:
        raise ConfigError(missing)
    if shutil.which(python) is None and not Path(python).is_file():
        raise ConfigError(f"{where}: {python} not found")
    return python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


_WHERE = re.compile(r"\[[\w./-]+\.py:\d+\]")


def _level(line: str) -> str | None:
    """What of a server's output is worth an event: its warnings and errors, and a traceback."""
    if " ERROR " in line or line.startswith(("Traceback", "RuntimeError", "ValueError")):
        return "error"
    if " WARNING " in line:
        return "warning"
    return None


class SupervisedServer:
    def __init__(
        self,
        name: str,
        argv: Callable[[int], Sequence[str]],
        *,
        log_path: Path,
        log: Log = lambda level, message: None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        max_restarts: int = 5,
        backoff_s: float = 2.0,
        health_path: str = "/health",
        on_failed: Callable[[str], object] = lambda reason: None,
        cpus: frozenset[int] = frozenset(),
    ):
        self.name, self._argv, self.log_path, self._log = name, argv, log_path, log
        self._env = {**os.environ, **(env or {})}
        self.startup_timeout_s, self.max_restarts, self.backoff_s = startup_timeout_s, max_restarts, backoff_s
        self.health_path = health_path
        self._on_failed = on_failed
        self.port = free_port()
        self.restarts = 0
        self.failed: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ended: subprocess.Popen[bytes] | None = None  # whose group is already stopped
        self._record = ServerRecord(log_path)
        self._stopping = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=20)  # the current process's lines only
        self._watcher: threading.Thread | None = None
        self._pump_thread: threading.Thread | None = None
        self._seen: dict[str, int] = {}
        self._apart = CoresApart(cpus)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        """Start and wait until healthy; the base URL (no ``/v1``)."""
        stop_leftovers(self.log_path.parent, self._log)  # a server a killed engine left holds the GPU
        try:
            self._apart.check("[serve] cpus")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._apart.__enter__()
        if self._apart.cores:
            where = f"on cores {cpu_list(self._apart.cores)}"
            if self._apart.kept:
                self._log("info", f"{self.name}: {where}; eagleops keeps to cores {cpu_list(self._apart.kept)} until it stops")
            else:
                self._log("warning", f"{self.name}: {where}, which are all of eagleops' cores: they share them")
        self._spawn()
        self._wait_healthy()
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True)
        self._watcher.start()
        self._log("info", f"{self.name}: serving on {self.base_url} (log {self.log_path})")
        return self.base_url

    def stop(self) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc is not self._ended:
            self._end(proc)
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        self._record.remove()
        self._apart.__exit__()

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop ``proc``'s whole group, once: its number may be reused once the group is empty."""
        stop_group(proc)
        self._ended = proc

    def __enter__(self) -> SupervisedServer:
        try:
            self.start()
        except BaseException:
            self.stop()  # whatever it started goes too
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = tethered(self._argv(self.port), self._apart.cores)
        env = {**self._env, **self._record.renew()}
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._record.write(self._proc.pid)
        except OSError as exc:  # a full disk must not stop the server; the tether still ends it with us
            self._log(
                "warning",
                f"{self.name}: its process group is not recorded ({exc}); a resume cannot find it should eagleops and its tether both be killed",
            )
        # a fresh tail: a failure quotes the lines of the process that failed, not its predecessor's
        self._tail = collections.deque(maxlen=20)
        self._pump_thread = threading.Thread(target=self._pump, args=(self._proc, self._tail), name=f"log-{self.name}", daemon=True)
        self._pump_thread.start()

    def _pump(self, proc: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
        if proc.stdout is None:
            return
        with open(self.log_path, "ab") as file:
            for raw in proc.stdout:
                file.write(raw)
                file.flush()
                line = raw.decode("utf-8", "replace").rstrip()
                tail.append(line)
                if (level := _level(line)) is not None and self._first_few(line):
                    self._log(level, f"{self.name}: {line[-400:]}")

    def _first_few(self, line: str, keep: int = 3) -> bool:
        """Whether a line is among the first few from its source location (``[utils.py:333]``):
        a server warns once per weight or per request, and the log must stay readable."""
        where = _WHERE.search(line)
        key = where.group(0) if where else line
        seen = self._seen.get(key, 0) + 1
        self._seen[key] = seen
        if seen == keep + 1:
            self._log("info", f"{self.name}: more lines from {key} are in {self.log_path.name} only")
        return seen <= keep

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.health_path, timeout=5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._healthy():
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                self._end(proc)  # what it started may live on
                raise ServerFailed(f"{self.name} exited with {proc.returncode} while starting; see {self.log_path}: {self._last_words()}")
            if self._stopping.is_set():
                raise ServerFailed(f"{self.name}: stopped while starting")
            if time.monotonic() > deadline:
                if proc is not None:
                    self._end(proc)  # not self.stop(): this may be the watcher thread itself
                raise ServerFailed(f"{self.name} not healthy after {self.startup_timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.5)

    def _last_words(self) -> str:
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=2)  # a dead process's last lines may still be in the pipe
        return " | ".join(list(self._tail)[-3:])

    def _watch(self) -> None:
        """Restart the server when it dies, unless we stopped it."""
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            proc.wait()
            if self._stopping.is_set():
                return
            if proc is not self._ended:
                self._end(proc)  # a crashed server's children (vLLM's workers) live on otherwise
            self._log("error", f"{self.name} died (exit {proc.returncode}): {self._last_words()}")
            if self.restarts >= self.max_restarts:
                self.failed = f"{self.name} died {self.restarts + 1} times; not restarted again (see {self.log_path})"
                self._log("error", self.failed)
                self._on_failed(self.failed)
                return
            delay = min(60.0, self.backoff_s * 2**self.restarts)
            self.restarts += 1
            self._log("warning", f"{self.name}: restart {self.restarts}/{self.max_restarts} in {delay:.0f}s")
            if self._stopping.wait(delay):
                return
            try:
                self._spawn()
                self._wait_healthy()
            except ServerFailed as exc:
                self._log("error", str(exc))
                continue
            self._log("info", f"{self.name}: back on {self.base_url}")
