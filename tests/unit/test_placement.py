"""Where processes run: core lists as taskset writes them, and a server's cores kept apart from ours."""

from __future__ import annotations

import os
import threading

import pytest

from eagleops.pipeline import placement


def test_core_lists_read_and_write_as_taskset_does():
    assert placement.parse_cpu_list("1-3,6") == {1, 2, 3, 6}
    assert placement.parse_cpu_list(" 0 , 2 ") == {0, 2} and placement.parse_cpu_list("") == frozenset()
    assert placement.cpu_list({6, 0, 1, 2, 9, 10}) == "0-2,6,9-10" and placement.cpu_list(set()) == ""
    for bad in ("3-1", "a", "1-", "-2", "1;2"):
        assert not placement.is_cpu_list(bad), bad
        with pytest.raises(ValueError):
            placement.parse_cpu_list(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="keeping apart needs two cores")
def test_keeping_apart_moves_every_thread_and_gives_the_cores_back():
    mine = frozenset(os.sched_getaffinity(0))
    server = frozenset({max(mine)})
    parked, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:  # a thread that was there before: moved too, not only the caller
        tid.append(threading.get_native_id())
        parked.set()
        done.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    parked.wait(30)
    try:
        with placement.CoresApart(server) as apart:
            assert apart.kept == mine - server
            assert os.sched_getaffinity(0) == apart.kept and os.sched_getaffinity(tid[0]) == apart.kept
        assert os.sched_getaffinity(0) == mine and os.sched_getaffinity(tid[0]) == mine
    finally:
        done.set()
        thread.join()
        placement._set_every_thread(mine)  # whatever failed above, the rest of the run keeps its cores
    with pytest.raises(ValueError, match=r"\[serve\] cpus: cores 100000 are not among"):
        placement.CoresApart(frozenset({100000})).check("[serve] cpus")
    with placement.CoresApart(mine) as shared:  # every core to the server: nothing left to keep, nothing moved
        assert not shared.kept and os.sched_getaffinity(0) == mine
