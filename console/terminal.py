"""What the terminal can show. Over SSH, in tmux, on a Linux console or a serial line, a
non-UTF-8 locale or a limited TERM turns box drawing and block glyphs into garbage: those
terminals get ASCII (borders, bars, plots, marks) and the same information."""

from __future__ import annotations

import codecs
import locale
import os
from collections.abc import Callable, Mapping

__all__ = ["TerminalWatch", "ascii_only", "to_ascii", "watch_terminal"]

_LIMITED_TERMS = {"", "dumb", "linux", "vt100", "vt102", "vt220", "ansi", "cons25"}
_ASCII = str.maketrans(
    {
        **dict.fromkeys("█▉▊▋▌▍▎▏", "#"),
        "·": ".",
        "▁": "_",
        "▂": ".",
        "▃": "-",
        "▄": "-",
        "▅": "=",
        "▆": "+",
        "▇": "*",
        "▶": ">",
        "‖": "|",
        "✓": "+",
        "✗": "x",
        "↑": "^",
        "↓": "v",
        "…": "~",
        "—": "-",
        "→": ">",
        "°": "",
    }
)


def _locale_encoding(env: Mapping[str, str]) -> str:
    for name in ("LC_ALL", "LC_CTYPE", "LANG"):
        if value := env.get(name):
            if value in ("C", "POSIX"):
                return "ascii"
            return value.partition(".")[2].partition("@")[0] or "ascii"
    return locale.getpreferredencoding(False)


def ascii_only(env: Mapping[str, str] | None = None) -> bool:
    """True for a limited TERM (or none) or a locale whose encoding is not UTF-8;
    ``EAGLEOPS_ASCII=1`` / ``0`` decides outright."""
    env = os.environ if env is None else env
    if (forced := env.get("EAGLEOPS_ASCII")) in ("0", "1"):
        return forced == "1"
    if env.get("TERM", "") in _LIMITED_TERMS:
        return True
    try:
        return codecs.lookup(_locale_encoding(env)).name != "utf-8"
    except LookupError:
        return True


def to_ascii(text: str) -> str:
    return text.translate(_ASCII)


class TerminalWatch:
    """Ends the console when its terminal is gone or it is told to stop, whatever the event loop
    is doing. A terminal can vanish without a hangup (the pty's other end closed, the console
    not its session leader): Textual's input thread then spins on end-of-file and its writes
    fail. A terminal can also stop reading (an SSH link gone quiet): Textual's writer blocks, its
    queue fills, and the event loop blocks in it, so a signal handler that waits for the loop
    never runs. This one runs on its own thread: it asks the app to leave (``on_gone``, called
    on the loop thread's behalf), and ends the process outright if that has not happened within
    ``grace_s``; nothing eagleops started outlives it (servers are tethered to it)."""

    def __init__(self, fds: tuple[int, ...], on_gone: Callable[[int], None], *, interval_s: float = 0.5, grace_s: float = 5.0):
        import threading

        self.fds = fds
        self.on_gone = on_gone
        self.interval_s = interval_s
        self.grace_s = grace_s
        self._stopped = threading.Event()
        self._deadline_armed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eagleops-terminal-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the app is leaving by itself); an armed deadline still holds."""
        self._stopped.set()

    def terminal_gone(self) -> bool:
        """True when every fd's other end hung up or the fd is no longer a terminal."""
        import select

        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLHUP | select.POLLERR | select.POLLNVAL)
        try:
            events = dict(poller.poll(0))
        except OSError:
            return True
        return any(events.get(fd, 0) & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for fd in self.fds)

    def end(self, code: int) -> None:
        """Leave through the app, and for certain within ``grace_s``: callable from any thread
        and from a signal handler."""
        if self._deadline_armed.is_set():
            return
        self._deadline_armed.set()
        import threading

        threading.Thread(target=self._deadline, args=(code,), name="eagleops-exit-deadline", daemon=True).start()
        self.on_gone(code)

    def _deadline(self, code: int) -> None:
        # never called off: if the app left in time the process is gone before this wakes; if
        # it is still here (a summary printed into a terminal that reads nothing), it must go
        import time

        time.sleep(self.grace_s)
        os._exit(code)

    def _watch(self) -> None:
        while not self._stopped.wait(self.interval_s):
            if self.terminal_gone():
                self.end(129)
                return


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _end_on_signal(watch: TerminalWatch, code: int, signum: int, frame: object) -> None:
    watch.end(code)


def watch_terminal(leave: Callable[[int], None]) -> TerminalWatch:
    """Watch stdin/stdout (those that are terminals) and take SIGHUP (129) and SIGTERM (130)
    with plain signal handlers: loop.add_signal_handler's would wait for an event loop that a
    terminal which reads nothing has blocked. ``leave(code)`` must be callable from any thread."""
    import signal
    from functools import partial

    watch = TerminalWatch(tuple(fd for fd in (0, 1) if _isatty(fd)), leave)
    for sig, code in ((signal.SIGHUP, 129), (signal.SIGTERM, 130)):
        try:
            signal.signal(sig, partial(_end_on_signal, watch, code))
        except ValueError:  # not the main thread (an embedding program's)
            pass
    if watch.fds:
        watch.start()
    return watch
