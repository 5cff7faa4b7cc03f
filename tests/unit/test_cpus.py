"""Thread counts from the cores a process really gets: affinity, cgroup quota, busy neighbours."""

from __future__ import annotations

import os

from eagleops.pipeline import cpus


def test_the_cgroup_quota_is_read_in_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpus._quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus._quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cpus._quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cpus._quota(tmp_path) is None


def test_threads_leave_busy_cores_alone_and_never_drop_below_one(monkeypatch):
    monkeypatch.delenv("EAGLEOPS_THREADS", raising=False)
    monkeypatch.setattr(cpus, "available_cores", lambda: 2.0)
    assert cpus.torch_threads(others=0.0)[0] == 2
    assert cpus.torch_threads(others=1.0) == (1, "2 cores, 1.0 busy elsewhere")
    assert cpus.torch_threads(others=1.9)[0] == 1
    assert cpus.torch_threads(0.5, others=0.0) == (1, "2 cores x 0.5, 0.0 busy elsewhere")
    monkeypatch.setattr(cpus, "available_cores", lambda: 16.0)
    assert cpus.torch_threads(others=3.2)[0] == 13
    monkeypatch.setenv("EAGLEOPS_THREADS", "3")
    assert cpus.torch_threads(others=15.0) == (3, "EAGLEOPS_THREADS")


def test_the_cores_a_process_may_use_are_at_most_its_affinity():
    assert 0 < cpus.available_cores() <= len(os.sched_getaffinity(0))
    assert cpus.busy_elsewhere(0.05) >= 0.0
