"""The console's own terminal going away, as a person's does: an SSH client killed, a tmux server
gone, a pty whose other end is closed with no hangup sent (the console is not the terminal's
session leader: started by a supervisor, a pager, `script`). The console must exit within seconds,
and SIGTERM must always end it; the run it attached to goes on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.integration.test_console import _env, _run_file, _wait_for_socket

GONE_WITHIN_S = 10.0  # a console polls its terminal every second; the rest is closing the link


class Terminal:
    """A pty whose slave end is the console's stdin, stdout and stderr, but not its controlling
    terminal; a thread drains what the console writes, as a terminal emulator would."""

    def __init__(self, argv: list[str], size: tuple[int, int] = (80, 24)):
        import fcntl
        import struct
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        env = {**_env(), "TERM": "xterm-256color"}
        self.process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.received = bytearray()
        self.draining = True
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        import select

        while True:
            try:
                if not self.draining or not select.select([self.master], [], [], 0.1)[0]:
                    time.sleep(0.05) if not self.draining else None
                    continue
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.received += data

    def wait_for(self, needle: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.received:
            assert self.process.poll() is None, f"the console exited early: {bytes(self.received[-2000:])!r}"
            assert time.monotonic() < deadline, f"{needle!r} never shown: {bytes(self.received[-2000:])!r}"
            time.sleep(0.1)

    def resize(self, columns: int, rows: int) -> None:
        """As a terminal emulator does: the new size, then SIGWINCH (no controlling terminal here
        sends it for us)."""
        import fcntl
        import struct
        import termios

        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        os.kill(self.process.pid, signal.SIGWINCH)

    def close_other_end(self) -> None:
        os.close(self.master)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(self.master)


def _exits_within(process: subprocess.Popen, seconds: float) -> int | None:
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def detached_run(tmp_path, fault_server):
    run = _run_file(tmp_path, fault_server.base_url)
    engine = subprocess.Popen(
        [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield asyncio.run(asyncio.to_thread(_wait_for_socket)), engine
    finally:
        with contextlib.suppress(ProcessLookupError):
            engine.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.wait(30)
        if engine.poll() is None:
            engine.kill()


def test_an_attached_console_whose_terminal_closed_without_a_hangup_exits(detached_run):
    socket, engine = detached_run
    terminal = Terminal([sys.executable, "-m", "eagleops", "attach", str(socket)])
    try:
        terminal.wait_for(b"B2")
        terminal.close_other_end()
        code = _exits_within(terminal.process, GONE_WITHIN_S)
        cpu = None if code is not None else psutil.Process(terminal.process.pid).cpu_percent(1.0)
        assert code is not None, f"the console outlived its terminal (at {cpu}% of a core)"
        assert code == 129  # as a hangup ends it
        assert engine.poll() is None  # the run goes on without its console
    finally:
        terminal.kill()


def test_sigterm_ends_a_console_whose_terminal_stopped_reading(detached_run):
    """A terminal that hangs (an SSH link gone quiet, a suspended tmux client): the console's
    writes block once the pty's buffer is full; SIGTERM must still end it."""
    socket, engine = detached_run
    terminal = Terminal([sys.executable, "-m", "eagleops", "attach", str(socket)])
    try:
        terminal.wait_for(b"B2")
        terminal.draining = False  # nothing reads any more: the pty's buffer fills, writes block
        for size in [(100, 30), (80, 24)] * 4:  # whole repaints, until the buffer is full
            terminal.resize(*size)
            time.sleep(0.3)
        terminal.process.send_signal(signal.SIGTERM)
        code = _exits_within(terminal.process, GONE_WITHIN_S)
        assert code is not None, "SIGTERM did not end a console whose terminal stopped reading"
        assert code == 130
        assert engine.poll() is None
    finally:
        terminal.kill()
