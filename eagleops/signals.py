"""A headless run's signals from its first millisecond. The entry point (``eagleops.__main__``)
installs them before it imports anything heavy, long before the engine takes them over: a hangup
leaves the run going, its output then going nowhere; SIGTERM is the clean kill (exit 130). Both as
the engine takes them once it runs. Importing this module changes nothing."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from eagleops.pipeline.errors import ExitCode

__all__ = ["hung_up", "install_headless_signals"]

_hung_up = False


def hung_up() -> bool:
    """Whether the terminal went before the engine took the signals over."""
    return _hung_up


def install_headless_signals(argv: Sequence[str]) -> bool:
    """Take SIGHUP and SIGTERM when ``argv`` runs headless (``--no-tui``, ``--json``); whether it did."""
    if not {"--no-tui", "--json"} & set(argv):
        return False
    signal.signal(signal.SIGHUP, _hangup)
    signal.signal(signal.SIGTERM, _terminate)
    return True


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
    os._exit(ExitCode.KILLED)
