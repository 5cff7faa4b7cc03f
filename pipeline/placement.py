"""Where a process runs: core lists as ``taskset -c`` writes them, and a server we start kept on
cores of its own (``[serve] cpus``) with this process on the rest while it runs (``CoresApart``).
Standard library only: the config checks its core lists with it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

__all__ = ["CoresApart", "cpu_list", "is_cpu_list", "parse_cpu_list"]


def parse_cpu_list(text: str) -> frozenset[int]:
    """Cores as ``taskset -c`` and ``/proc/*/status`` write them: ``"1"``, ``"1-3,6"``; empty: none."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        if not (low.isdigit() and (high.isdigit() if dash else True)):
            raise ValueError(f"{part!r} is not a core or a range of cores (like 1-3)")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{part!r} runs backwards")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def is_cpu_list(text: str) -> bool:
    try:
        parse_cpu_list(text)
    except ValueError:
        return False
    return True


def cpu_list(cores: Iterable[int]) -> str:
    """The short form of a set of cores: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _set_every_thread(cores: frozenset[int]) -> None:
    """``sched_setaffinity`` moves one thread; a process is all of them (aiohttp's resolver, torch's pool)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


class CoresApart:
    """Keep this process off a server's cores while it runs, and give them back after.

    vLLM's engine core spin-waits for its model workers (``sched_yield``, up to a second after
    each output), so it keeps a core busy even for a small model. On a machine where eagleops and
    the server share a few cores the scheduler may leave eagleops' event loop waiting behind the
    spinner for seconds, and the server idles for want of requests (bench/RESULTS.md, issue 24).
    A server started on ``cores`` and eagleops on the rest never meet."""

    def __init__(self, cores: frozenset[int]):
        self.cores = cores
        self.mine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.kept = self.mine - cores  # ours while the server runs; empty: we share its cores
        self.active = False

    def check(self, where: str) -> None:
        """The server's cores must be among ours: a process may only narrow what it was given."""
        if self.cores and not self.cores <= self.mine:
            raise ValueError(
                f"{where}: cores {cpu_list(self.cores - self.mine)} are not among this process's cores ({cpu_list(self.mine)})"
            )

    def __enter__(self) -> CoresApart:
        if self.cores and self.kept and not self.active:
            _set_every_thread(self.kept)
            self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            _set_every_thread(self.mine)
            self.active = False
