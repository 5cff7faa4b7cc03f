"""How many CPU threads a torch stage or a server of ours should run: the cores this process may
use (its affinity and its cgroup's CPU quota), less what other processes are using right now.

torch starts one OpenMP thread per core it sees and spins them at every barrier; beside another
busy process on a small machine that is the worst choice there is (threads wait for a core the
other process holds, each step pays for it). One thread fewer per busy core costs little when the
machine is quiet and saves most of the loss when it is not: ``bench/cpu_threads.py`` measures it.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = ["apply_torch_threads", "available_cores", "busy_elsewhere", "torch_threads"]

_CGROUP = Path("/sys/fs/cgroup")


def _quota(root: Path = _CGROUP) -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def available_cores() -> float:
    """The cores this process may run on: its affinity, capped by its cgroup's quota."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    quota = _quota()
    return min(cores, quota) if quota else cores


def busy_elsewhere(sample_s: float = 0.2) -> float:
    """Cores other processes kept busy over a short sample, counted on the cores this process may
    run on only (a container's neighbours on other cores take nothing from it), less our own use."""
    try:
        import psutil
    except ImportError:
        return 0.0
    try:
        mine_cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine_cores = list(range(psutil.cpu_count() or 1))
    me = psutil.Process()
    mine_before = sum(me.cpu_times()[:2])
    psutil.cpu_percent(None, percpu=True)
    time.sleep(sample_s)
    per_core = psutil.cpu_percent(None, percpu=True)
    used = sum(per_core[c] for c in mine_cores if c < len(per_core)) / 100
    mine = (sum(me.cpu_times()[:2]) - mine_before) / sample_s
    return max(0.0, used - mine)


def torch_threads(share: float = 1.0, *, others: float | None = None) -> tuple[int, str]:
    """(threads, why) for torch work that gets ``share`` of the cores: what we may use, less the
    cores busy elsewhere (rounded to the nearest whole core), at least one. ``EAGLEOPS_THREADS``
    (a count) wins."""
    if (forced := os.environ.get("EAGLEOPS_THREADS", "").strip()).isdigit() and int(forced) > 0:
        return int(forced), "EAGLEOPS_THREADS"
    cores = available_cores()
    busy = busy_elsewhere() if others is None else others
    threads = max(1, math.floor(cores * share - busy + 0.5))
    return threads, f"{cores:g} cores{f' x {share:g}' if share != 1 else ''}, {busy:.1f} busy elsewhere"


def apply_torch_threads(share: float = 1.0, *, others: float | None = None) -> tuple[int, str]:
    """Set torch's intra-op threads for this process from ``torch_threads``; (count, why)."""
    import torch

    threads, why = torch_threads(share, others=others)
    torch.set_num_threads(threads)
    return threads, why
