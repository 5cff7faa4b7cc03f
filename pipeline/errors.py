"""One exception family for everything eagleops refuses or cannot finish.

``UsageError`` (a run file, an argument or an input file the user gave is wrong) exits 2 and
names the file and the key or line; ``RunError`` (a run that cannot go on: a locked output
directory, a store that does not match its manifest, an engine that does not answer) exits 1.
The command line catches ``EagleOpsError`` alone and exits with its ``exit_code``. Every exit
status eagleops gives is an ``ExitCode``.
"""

from __future__ import annotations

import enum

__all__ = ["ConfigError", "EagleOpsError", "ExitCode", "InputError", "RunError", "UsageError"]


class ExitCode(enum.IntEnum):
    """What a run's exit status says, the one list of them (docs/operations.md has the table)."""

    OK = 0
    FAILED = 1  # a stage failed, or the run could not go on (RunError)
    USAGE = 2  # a run file, an argument or an input file is wrong; nothing ran because of it
    SHORTFALL = 3  # every stage finished, but a dataset's output is mostly failures, or empty
    KILLED = 130  # SIGTERM, SIGINT or `eagleops kill`: stopped cleanly, resumable


class EagleOpsError(Exception):
    """Base of every error eagleops raises on purpose; its message is meant for a person."""

    exit_code: int = ExitCode.FAILED


class UsageError(EagleOpsError):
    """What the user gave is wrong; nothing was run or written because of it."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError, ValueError):
    """A run file that cannot be used; the message names the file and the key."""


class InputError(UsageError, ValueError):
    """An input file (a dataset, generated records, a pre-tokenized set) that cannot be used;
    the message names the file, the line and the field."""


class RunError(EagleOpsError, RuntimeError):
    """A run that cannot go on; what was already written is kept."""
