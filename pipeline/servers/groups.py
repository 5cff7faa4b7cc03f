"""The process groups of the servers we start: stop one whole, and find again the ones an engine
that died left running.

Each server runs in its own process group, led by a tether (``tether.py``) that ends the group
when eagleops dies. Should the tether die too (an OOM kill, a ``kill -9`` of both), the group
outlives them; so every start is recorded next to the server's log, ``<name>.pid.json``: the
leader's pid and start time, a token in the environment of every process of the group, and the
engine that started it. The next start in that folder stops what a dead engine's records name,
by pid *and* start time, or by the token: never by name, never a process that is not ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from eagleops.pipeline.files import write_json_atomic
from eagleops.pipeline.servers.tether import TOKEN_ENV

__all__ = ["TOKEN_ENV", "ServerRecord", "stop_group", "stop_leftovers"]

RECORD_SUFFIX = ".pid.json"
TERM_GRACE_S = 20.0  # vLLM's graceful shutdown; then SIGKILL
KILL_GRACE_S = 5.0

Log = Callable[[str, str], object]


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (vLLM's engine core and workers are children), then SIGKILL it.

    The SIGKILL goes to the group even when the leader has exited: a crashed leader's children
    live on, and ``killpg`` reaches them while any member lives. Call it while the leader is
    alive or just after it was reaped, never later: the group's number is only ours while the
    group has members."""
    for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _same_process(pid: int, started: float) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (pids are reused)."""
    now = _start_time(pid)
    return now is not None and abs(now - started) < 0.01


class ServerRecord:
    """Where one server's group is recorded, and the token its processes carry."""

    def __init__(self, log_path: Path):
        self.path = log_path.with_name(log_path.stem + RECORD_SUFFIX)
        self.token = uuid.uuid4().hex

    def renew(self) -> dict[str, str]:
        """A new token, for a new process: the environment entry that carries it."""
        self.token = uuid.uuid4().hex
        return {TOKEN_ENV: self.token}

    def write(self, leader: int) -> None:
        started = _start_time(leader)
        owner = _start_time(os.getpid())
        if started is None or owner is None:
            return  # already dead: the watcher sees it; there is nothing left to find
        record = {"pid": leader, "started": started, "token": self.token, "owner": {"pid": os.getpid(), "started": owner}}
        write_json_atomic(self.path, record)

    def remove(self) -> None:
        """Forget the group once it is stopped (only our own record: another may have replaced it)."""
        with contextlib.suppress(OSError):
            if _read(self.path).get("token") == self.token:
                self.path.unlink()


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _members(record: dict[str, Any]) -> list[psutil.Process]:
    """The live processes of a recorded server: its leader (same pid, same start time), every
    process carrying its token, wherever it has moved since, and the members of its group.

    vLLM's engine core and workers write their title over their environment (setproctitle), so
    the token is not enough: they are found by their group, the number of which stays ours while
    any member lives. A group is taken for ours only if it has no leader but ours, and only its
    members started after ours."""
    leader, started, token = record.get("pid"), record.get("started"), record.get("token")
    if not isinstance(leader, int) or not isinstance(started, int | float):
        return []
    leader_now = _start_time(leader)
    group_is_ours = leader_now is None or abs(leader_now - started) < 0.01
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):  # OSError: os.getpgid of a process just gone
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.pid == leader:
                ours = group_is_ours
            elif group_is_ours and os.getpgid(proc.pid) == leader:
                ours = proc.create_time() >= started - 0.01
            else:
                ours = isinstance(token, str) and len(token) >= 16 and proc.environ().get(TOKEN_ENV) == token
            if ours:
                found.append(proc)
    return found


def _owner_alive(record: dict[str, Any]) -> bool:
    owner = record.get("owner")
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or not isinstance(owner.get("started"), int | float):
        return False
    return _same_process(owner["pid"], owner["started"])


def _end(procs: list[psutil.Process]) -> None:
    """SIGTERM, a grace, SIGKILL: psutil checks each is still the same process before signalling."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)


def stop_leftovers(folder: Path, log: Log) -> int:
    """Stop the servers that engines now dead left running, as their records in ``folder`` say;
    a live engine's servers are left alone. How many processes were stopped."""
    stopped = 0
    for path in sorted(folder.glob("*" + RECORD_SUFFIX)):
        record = _read(path)
        if _owner_alive(record):
            continue
        if procs := _members(record):
            name = path.name.removesuffix(RECORD_SUFFIX)
            log("warning", f"{name}: an earlier run left its server running (pid {record.get('pid')}); stopping its {len(procs)} processes")
            _end(procs)
            stopped += len(procs)
        with contextlib.suppress(OSError):
            path.unlink()
    return stopped
