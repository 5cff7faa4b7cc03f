"""The servers eagleops starts die with it and leave nothing behind: not when eagleops is killed
with SIGKILL, not when the server crashes (its children too), not across a resume. A restarted
server is back in rotation as soon as it answers /health, and a start-up failure quotes its own
output only. Each test failed before its fix.

Every process a test starts is found again by the folder in its ``$FAKE_VLLM_PIDS`` (unique to
the test, inherited by all its descendants) and killed at teardown, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from eagleops.pipeline.config import EndpointConfig
from eagleops.pipeline.generate.endpoints import EndpointPool
from eagleops.pipeline.servers.supervisor import ServerFailed, SupervisedServer, stop_group

ROOT = Path(__file__).resolve().parents[2]
FAKE_VLLM = ROOT / "bench" / "fake_vllm.py"
PIDS_ENV = "FAKE_VLLM_PIDS"


def _ours(pids: Path) -> list[psutil.Process]:
    """Live processes (not zombies) that carry this test's marker in their environment."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(PIDS_ENV) == str(pids) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (the same process: psutil checks its start time)."""
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _wait_until(condition: Callable[[], object], timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2):
            return True
    except OSError:
        return False


def _crash(base_url: str) -> None:
    request = urllib.request.Request(base_url + "/admin/crash", data=b"{}", method="POST")
    with contextlib.suppress(OSError):
        urllib.request.urlopen(request, timeout=5).close()


@pytest.fixture
def pids(tmp_path) -> Iterator[Path]:
    """The marker folder; at teardown every process carrying it is killed."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    for proc in _ours(folder):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _fake_server(name: str, tmp_path: Path, pids: Path, **options) -> SupervisedServer:
    return SupervisedServer(
        name,
        lambda port: [sys.executable, str(FAKE_VLLM), "--port", str(port)],
        log_path=tmp_path / "servers" / f"{name}.log",
        env={PIDS_ENV: str(pids)},
        startup_timeout_s=60,
        **options,
    )


# The engine of these tests: a process that starts a server the way the generate stage does
# (from a worker thread that may end while the server runs), says its process group, and waits.
_ENGINE = """
import sys, threading, time
from pathlib import Path
from eagleops.pipeline.servers.supervisor import SupervisedServer
folder, fake, pids = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
server = SupervisedServer("vllm-generate", lambda port: [sys.executable, fake, "--port", str(port)],
                          log_path=folder / "servers" / "vllm-generate.log", env={"FAKE_VLLM_PIDS": pids}, startup_timeout_s=60)
starter = threading.Thread(target=server.start)
starter.start()
starter.join()
(folder / "group.tmp").write_text(f"{server._proc.pid} {server.base_url}")
(folder / "group.tmp").rename(folder / "group")
time.sleep(600)
"""


@contextlib.contextmanager
def _engine(tmp_path: Path, pids: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, str]]:
    """An engine process serving the fake vLLM: (process, the server's process group, its URL)."""
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(tmp_path), str(FAKE_VLLM), str(pids)],
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert _wait_until(lambda: (tmp_path / "group").exists() or engine.poll() is not None, 90), "the engine never served"
        assert engine.poll() is None, f"the engine exited with {engine.returncode}"
        group, url = (tmp_path / "group").read_text().split()
        yield engine, int(group), url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()


# ---- 1. kill -9 of eagleops leaves its server running ---------------------------------------------


def test_a_server_dies_with_its_engine_killed_by_sigkill(tmp_path, pids):
    with _engine(tmp_path, pids) as (engine, group, url):
        time.sleep(1.0)  # the thread that started the server has ended: that must not stop it
        assert _healthy(url), "the server died with the thread that started it"
        served = _ours(pids)
        assert served
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()
        gone = _wait_until(lambda: not _alive(served), 30)
        assert gone, f"left running after the engine's SIGKILL: {[p.cmdline() for p in _alive(served)]}"


def test_a_resume_stops_the_server_a_killed_engine_left(tmp_path, pids):
    """The engine and the process leading its server's group both die at once (an OOM kill, a
    `kill -9` of both): nothing was left to end the group, so the next start must."""
    with _engine(tmp_path, pids) as (engine, group, url):
        os.kill(engine.pid, signal.SIGKILL)
        os.kill(group, signal.SIGKILL)
        engine.wait()
    left = _ours(pids)
    assert left, "nothing survived: the test would test nothing"
    events: list[tuple[str, str]] = []
    with _fake_server("vllm-generate", tmp_path, pids, log=lambda level, message: events.append((level, message))) as server:
        assert _healthy(server.base_url)
        assert not _alive(left), f"the previous engine's server is still running: {[p.cmdline() for p in _alive(left)]}"
    assert not _ours(pids)
    assert any(level == "warning" and "an earlier run left its server running" in m for level, m in events), events


def test_a_record_naming_someone_elses_process_stops_nothing(tmp_path, pids):
    """A pid recorded by an earlier run may since belong to another process: its start time tells."""
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True, env={**os.environ, PIDS_ENV: str(pids)})
    try:
        record = {"pid": bystander.pid, "started": 12345.0, "token": "x" * 32, "owner": {"pid": 2**22 + 1, "started": 1.0}}
        (tmp_path / "servers").mkdir()
        (tmp_path / "servers" / "vllm-generate.pid.json").write_text(json.dumps(record))
        with _fake_server("vllm-generate", tmp_path, pids):
            pass
        assert bystander.poll() is None, "a process that was never ours was stopped"
    finally:
        bystander.kill()
        bystander.wait()


# ---- 2. children of a crashed server are never killed ---------------------------------------------


def test_stop_group_kills_the_children_of_a_leader_already_dead(tmp_path, pids):
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.Popen(['sh', '-c', \"trap '' TERM; exec sleep 3600\"])"],
        start_new_session=True,
        env={**os.environ, PIDS_ENV: str(pids)},
    )
    leader.wait()
    assert _wait_until(lambda: _ours(pids), 10), "the child never started"
    stubborn = _ours(pids)
    stop_group(leader)
    assert _wait_until(lambda: not _alive(stubborn), 10), "a child that ignores SIGTERM outlived its group's stop"


def test_the_children_of_a_crashed_server_are_killed(tmp_path, pids):
    failures: list[str] = []
    server = _fake_server("vllm", tmp_path, pids, backoff_s=0.1, max_restarts=1, on_failed=failures.append)
    with server:
        first = _ours(pids)
        _crash(server.base_url)
        assert _wait_until(lambda: server.restarts == 1 and _healthy(server.base_url), 60), "never restarted"
        assert _wait_until(lambda: not _alive(first), 10), f"the crashed server's children live on: {_alive(first)}"
        second = [p for p in _ours(pids) if p not in first]
        _crash(server.base_url)
        assert _wait_until(lambda: failures, 30)
        assert _wait_until(lambda: not _alive(second), 10), f"the crashed server's children live on: {_alive(second)}"
    assert not _ours(pids)


def test_a_server_child_that_left_the_group_is_ended_too(tmp_path, pids):
    """A child in a session of its own (as daemons start) is out of reach of the group's signals:
    the token in its environment still names it."""
    escape = (
        "import subprocess, sys, time; subprocess.Popen(['sleep', '3600'], start_new_session=True); "
        "time.sleep(0.5); print('ValueError: no model here', flush=True); sys.exit(3)"
    )
    server = SupervisedServer(
        "escape", lambda port: [sys.executable, "-c", escape], log_path=tmp_path / "escape.log", env={PIDS_ENV: str(pids)}
    )
    with pytest.raises(ServerFailed, match="exited with 3 while starting"):
        server.start()
    assert _wait_until(lambda: not _ours(pids), 10), f"left running: {[p.cmdline() for p in _ours(pids)]}"


# ---- 11a. a start-up failure quotes the previous process's last lines --------------------------------


def test_a_restart_that_fails_quotes_only_its_own_output(tmp_path, pids):
    starts: list[int] = []
    fails = "import sys; print('ValueError: the second start fails', flush=True); sys.exit(4)"

    def argv(port: int) -> list[str]:
        starts.append(port)
        if len(starts) == 1:  # the first process serves, and says so in its last line
            return [sys.executable, str(FAKE_VLLM), "--port", str(port)]
        return [sys.executable, "-c", fails]

    events: list[tuple[str, str]] = []
    server = SupervisedServer(
        "vllm",
        argv,
        log_path=tmp_path / "vllm.log",
        log=lambda level, message: events.append((level, message)),
        env={PIDS_ENV: str(pids)},
        backoff_s=0.1,
        max_restarts=1,
        startup_timeout_s=60,
    )
    with server:
        _crash(server.base_url)
        assert _wait_until(lambda: any("while starting" in m for _, m in events), 30), events
    message = next(m for _, m in events if "while starting" in m)
    assert "the second start fails" in message
    assert "fake vLLM serving" not in message, message


# ---- 3. a restarted server's endpoint stays benched --------------------------------------------------


async def _drive(pool: EndpointPool, session: aiohttp.ClientSession, successes: list[float], stop: asyncio.Event) -> None:
    """A client in miniature: acquire, send, tell the pool how it went, again until stopped."""
    body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    while not stop.is_set():
        endpoint = await pool.acquire()
        try:
            async with session.post(endpoint.url, json=body, timeout=aiohttp.ClientTimeout(total=10)) as response:
                await response.read()
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        finally:
            pool.release(endpoint)
        if ok:
            pool.succeeded(endpoint)
            successes.append(time.monotonic())
        else:
            pool.failed(endpoint, "connection refused")
            await asyncio.sleep(0.02)


async def _health_returns(
    base_url: str, session: aiohttp.ClientSession, pool: EndpointPool, timeout_s: float
) -> tuple[float | None, float]:
    """When /health answers again after failing (None if it does not within ``timeout_s``), and
    the latest end of a bench the pool gave the endpoint meanwhile."""
    down, bench_ends = False, 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        bench_ends = max(bench_ends, pool.endpoints[0].benched_until)
        try:
            async with session.get(base_url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as response:
                up = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            up = False
        if down and up:
            return time.monotonic(), bench_ends
        down = down or not up
        await asyncio.sleep(0.02)
    return None, bench_ends


async def test_a_restarted_server_is_back_in_rotation_once_it_answers_health(tmp_path, pids):
    # a long restart backoff and a long bench: before the fix the endpoint sat out the whole bench
    server = _fake_server("vllm", tmp_path, pids, backoff_s=2.0, max_restarts=2)
    await asyncio.to_thread(server.start)
    stop, successes = asyncio.Event(), []
    endpoint = EndpointConfig(base_url=f"{server.base_url}/v1", model="target", kind="vllm")
    pool = EndpointPool((endpoint,), base_bench_s=20.0, max_bench_s=60.0)
    try:
        async with aiohttp.ClientSession() as session:
            workers = [asyncio.create_task(_drive(pool, session, successes, stop)) for _ in range(4)]
            await asyncio.to_thread(_wait_until, lambda: len(successes) >= 4, 30)
            threading.Thread(target=_crash, args=(server.base_url,)).start()
            back, bench_ends = await _health_returns(server.base_url, session, pool, 60)
            assert back is not None, "the server never came back"
            await asyncio.to_thread(_wait_until, lambda: successes[-1] > back, 15)
            stop.set()
            await asyncio.wait(workers, timeout=15)
        first = next((t for t in successes if t > back), None)
        assert first is not None, "no request succeeded within 15 s of the server answering /health"
        assert first < bench_ends, "back in rotation only when the bench ran out, not when /health answered"
        assert first - back < 5.0, f"first success {first - back:.1f}s after /health answered"
    finally:
        stop.set()
        close = getattr(pool, "close", None)
        if close is not None:
            await close()
        await asyncio.to_thread(server.stop)


# ---- the storm: eagleops killed again and again while it supervises a (fake) vLLM --------------------


def test_a_storm_of_kills_leaves_no_server_behind(tmp_path):
    """A few rounds here, one of each kind; ``python bench/fault_storm.py --servers 24`` for the storm.
    The storm kills whatever it started that is still running when it ends, however it ends."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fault_storm", ROOT / "bench" / "fault_storm.py")
    assert spec is not None and spec.loader is not None
    storm = sys.modules["fault_storm"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(storm)
    modes = ("with tether", "serving", "starting", "serving")  # a serving run after the tether round: its start is seen
    result = storm.run_server_storm(tmp_path, rounds=len(modes), seed=5, modes=modes, say=lambda _: None)
    assert result.kills == len(modes), result
    assert result.left_behind == 0 and result.clean, result
    assert result.stopped_by_resume >= 1, "the run after the tether's death stopped nothing"
