"""Runs a server as its child, and takes the server's whole process group down with eagleops.

    python -m eagleops.pipeline.servers.tether --parent PID [--cpus 1,2] -- ARGV...

The supervisor starts this as the leader of a new process group; the server and whatever it
starts (vLLM's API server, engine core and workers) join that group. The tether ends the group:

* when eagleops dies, however it dies (``kill -9`` included). The kernel's parent-death signal
  says so at once; it fires when the *thread* that started us ends, though, so on that signal
  the parent's pid tells a dead engine from a finished thread, and a poll of that pid every half
  second catches what the signal cannot;
* when the server exits: its children would live on (a crashed vLLM's workers keep the GPU);
* when asked to (SIGTERM, SIGINT, SIGHUP): the server gets ``STOP_GRACE_S`` to shut down.

With ``--cpus`` the server starts on those cores only (what it starts inherits them).

It then exits as the server did (the same code, or killed by the same signal), so a supervisor
sees the server's own end. Linux only (``prctl`` and ``/proc``), standard library only: it loads
before the server and must stay small.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence

__all__ = ["TOKEN_ENV", "tethered"]

TOKEN_ENV = "EAGLEOPS_SERVER_ID"  # set by the supervisor, so in the environment of all a server starts

PARENT_GONE = signal.SIGUSR1  # our parent-death signal: one that nothing else sends us
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WATCHED = {signal.SIGCHLD, PARENT_GONE, *STOP_SIGNALS}
POLL_S = 0.5
STOP_GRACE_S = 15.0  # vLLM's own shutdown frees the GPU cleanly; a supervisor's stop waits 20 s
REST_GRACE_S = 2.0  # for what is left of the group once the server itself has exited
_PR_SET_PDEATHSIG = 1


def tethered(argv: Sequence[str], cpus: Collection[int] = ()) -> list[str]:
    """``argv`` run under a tether to this process: it dies when this process dies. With
    ``cpus``, the server and whatever it starts run on those cores only."""
    placement = ["--cpus", ",".join(map(str, sorted(cpus)))] if cpus else []
    return [sys.executable, "-m", "eagleops.pipeline.servers.tether", "--parent", str(os.getpid()), *placement, "--", *argv]


def _say(line: str) -> None:
    """A line for the server's log. Its reader is the engine: once that is dead, the pipe is
    broken, and a failed write must not keep the tether from ending the group."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def _set_parent_death_signal(sig: int) -> None:
    """Ask the kernel for ``sig`` when the thread that started this process ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (AttributeError, OSError):
        pass  # not Linux: the poll of the parent's pid alone notices


def _start_server(argv: list[str]) -> subprocess.Popen[bytes]:
    def in_child() -> None:  # runs in the forked child; the tether has one thread, so it is safe
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the server must not inherit our blocked signals
        _set_parent_death_signal(signal.SIGTERM)  # should the tether itself be SIGKILLed

    return subprocess.Popen(argv, preexec_fn=in_child)


def _others() -> list[int]:
    """The other live processes of this server: the members of its process group, and those that
    left the group (a new session: Ray's daemons, say) but carry its token in their environment.
    A zombie is left out: it is dead, only not yet reaped."""
    me, group = os.getpid(), os.getpgrp()
    token = os.environ.get(TOKEN_ENV)
    entry = f"{TOKEN_ENV}={token}".encode() if token else None
    try:
        names = os.listdir("/proc")
    except OSError:
        return []  # no /proc (not Linux): the supervisor's signals to the group do the rest
    found = []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                stat = file.read()
            fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
            if fields[0] in (b"Z", b"X"):
                continue
            if int(fields[2]) == group or (entry is not None and entry in _environment(name)):
                found.append(int(name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _environment(pid: str) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as file:
        return file.read().split(b"\0")


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _end_the_rest(grace_s: float) -> None:
    """SIGTERM every other process of the server, then SIGKILL what is left after ``grace_s``.
    Never SIGKILL the whole group at once: the tether must live on to exit as the server did."""
    others = _others()
    if not others:
        return
    os.killpg(0, signal.SIGTERM)  # ours is blocked, so it only waits, unread
    _signal_all(others, signal.SIGTERM)  # for those outside the group
    deadline = time.monotonic() + grace_s
    while _others() and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(10):  # a process may fork between two looks
        left = _others()
        if not left:
            return
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.05)


def _exit_like(code: int) -> None:
    """Exit with the server's code, or die of the signal that killed it."""
    if code < 0:
        sig = signal.Signals(-code)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose handling cannot be set
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        code = 128 - code  # a signal we could not die of
    os._exit(code)


def _stop(server: subprocess.Popen[bytes], *, tell_the_group: bool) -> int:
    if tell_the_group:
        os.killpg(0, signal.SIGTERM)
    try:
        code = server.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
    _end_the_rest(REST_GRACE_S)
    return code


def run(parent: int, argv: list[str]) -> int:
    """Serve ``argv`` while ``parent`` lives; the server's exit code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)  # read with sigtimedwait, never by handlers
    _set_parent_death_signal(PARENT_GONE)
    if os.getppid() != parent:  # it died before the kernel could be asked to tell us
        return 0
    try:
        server = _start_server(argv)
    except OSError as exc:
        _say(f"tether ERROR cannot start {argv[0]}: {exc.strerror}")
        return 127
    while True:
        if (code := server.poll()) is not None:
            _end_the_rest(REST_GRACE_S)
            return code
        if os.getppid() != parent:
            _say(f"tether: eagleops (pid {parent}) is gone; stopping the server's process group")
            return _stop(server, tell_the_group=True)
        info = signal.sigtimedwait(WATCHED, POLL_S)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if info.si_signo == PARENT_GONE:
            continue  # the pid check above tells a dead engine from a thread of it that ended
        # a supervisor signals the whole group; anyone else may have signalled us alone
        return _stop(server, tell_the_group=info.si_pid != parent)


def main(argv: list[str]) -> None:
    cpus: set[int] = set()
    if len(argv) > 4 and argv[2] == "--cpus":
        cpus = {int(core) for core in argv[3].split(",")}
        argv = argv[:2] + argv[4:]
    if len(argv) < 4 or argv[0] != "--parent" or argv[2] != "--":
        raise SystemExit("usage: python -m eagleops.pipeline.servers.tether --parent PID [--cpus 1,2] -- ARGV...")
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # before the server starts: all it starts inherits them
        code = run(int(argv[1]), argv[3:])
    except Exception as exc:  # whatever went wrong, no server outlives its tether
        _say(f"tether ERROR {exc!r}; stopping the server's process group")
        _end_the_rest(REST_GRACE_S)
        code = 1
    _exit_like(code)


if __name__ == "__main__":
    main(sys.argv[1:])
