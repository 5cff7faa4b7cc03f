"""A headless run's signals from its first millisecond: importing this module (the command line
does, before anything heavy) installs them, long before the engine installs its own. A hangup
leaves the run going, its output then going nowhere; SIGTERM is the clean kill (exit 130).
Both as the engine takes them once it runs."""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["hung_up"]

_hung_up = False


def hung_up() -> bool:
    """Whether the terminal went before the engine took the signals over."""
    return _hung_up


def _hangup(signum: int, frame: object) -> None:
    global _hung_up
    _hung_up = True
    for stream in (sys.stdout, sys.stderr):  # later writes and the exit flush must not fail
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def _terminate(signum: int, frame: object) -> None:
    # the engine has not started: nothing is in flight, and what is on disk is always consistent
    os._exit(130)


if {"--no-tui", "--json"} & set(sys.argv[1:]):
    signal.signal(signal.SIGHUP, _hangup)
    signal.signal(signal.SIGTERM, _terminate)
