"""Server supervision without vLLM: restart after a crash, a clear failure when it cannot start,
and the engine's generate stage failing cleanly when its served target does not come up."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from eagleops.pipeline.engine import Engine
from eagleops.pipeline.errors import ConfigError
from eagleops.pipeline.protocol.events import StageStatus
from eagleops.pipeline.servers.supervisor import ServerFailed, SupervisedServer
from tests.conftest import make_config, write_jsonl


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def _fault_server(tmp_path: Path, events: list[tuple[str, str]] | None = None, **options) -> SupervisedServer:
    """Our fault server, supervised; its log lines into ``events`` when given."""
    log = (lambda level, message: events.append((level, message))) if events is not None else (lambda level, message: None)
    return SupervisedServer(
        "fault",
        lambda port: [sys.executable, "-m", "eagleops.pipeline.testservers.fault", "--port", str(port)],
        log_path=tmp_path / "fault.log",
        log=log,
        startup_timeout_s=60,
        **options,
    )


def test_a_killed_server_is_restarted_and_stopped_for_good(tmp_path):
    events: list[tuple[str, str]] = []
    server = _fault_server(tmp_path, events, backoff_s=0.1, max_restarts=2)
    with server:
        first = server._proc.pid
        os.killpg(first, signal.SIGKILL)  # as the OOM killer would
        for _ in range(600):
            if server.restarts == 1 and _alive(server.base_url):
                break
            time.sleep(0.05)
        assert server.restarts == 1 and _alive(server.base_url)
        second = server._proc.pid
        assert second != first
    assert any(level == "error" and "died" in message for level, message in events)
    assert any("restart 1/2" in message for _, message in events)
    with pytest.raises(ProcessLookupError):
        os.killpg(second, 0)  # the whole group is gone


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a server on cores of its own needs two")
def test_a_server_on_its_own_cores_and_eagleops_on_the_rest(tmp_path):
    import psutil

    mine = frozenset(os.sched_getaffinity(0))
    cores = frozenset({max(mine)})
    events: list[tuple[str, str]] = []
    server = _fault_server(tmp_path, events, cpus=cores)
    try:
        with server:
            tree = [psutil.Process(server._proc.pid), *psutil.Process(server._proc.pid).children(recursive=True)]
            assert len(tree) >= 2 and all(set(p.cpu_affinity()) == cores for p in tree)  # the tether and the server
            assert os.sched_getaffinity(0) == mine - cores
            assert all(os.sched_getaffinity(t.native_id) == mine - cores for t in threading.enumerate() if t.native_id)
        assert os.sched_getaffinity(0) == mine  # given back when it stops
    finally:
        os.sched_setaffinity(0, mine)
    assert any("eagleops keeps to cores" in message for _, message in events)
    outside = SupervisedServer("fault", lambda port: ["true"], log_path=tmp_path / "x.log", cpus=frozenset({100000}))
    with pytest.raises(ConfigError, match=r"\[serve\] cpus: cores 100000 are not among this process's cores"):
        outside.start()


def test_a_server_that_cannot_start_fails_with_its_last_words(tmp_path):
    server = SupervisedServer(
        "broken",
        lambda port: [sys.executable, "-c", "import sys; print('ValueError: no such model /nowhere'); sys.exit(3)"],
        log_path=tmp_path / "broken.log",
        startup_timeout_s=60,
    )
    with pytest.raises(ServerFailed, match=r"exited with 3 while starting.*no such model"):
        server.start()


async def test_generate_fails_cleanly_when_its_served_target_does_not_start(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ERROR 12-03 vllm: out of memory'\nexit 1\n")
    fake.chmod(0o755)
    source = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hi"}])
    config = make_config(
        tmp_path,
        "http://127.0.0.1:9/v1",
        [{"name": "A", "path": str(source), "token_budget": 100}],
        endpoints=[],
        serve={"python": str(fake), "model": str(tmp_path)},
    )
    engine = Engine(config)
    logs = engine.subscribe()
    summary = await engine.run()
    assert not summary.ok and summary.stages["generate"] == StageStatus.FAILED
    messages = [e.message for e in [event async for event in logs] if e.kind == "log"]
    assert any("out of memory" in m for m in messages), messages
    assert Path(config.output_dir / "servers" / "vllm-generate.log").exists()
    assert asyncio.get_running_loop().is_running()


def test_a_server_that_dies_for_good_is_reported_once(tmp_path):
    failures: list[str] = []
    server = _fault_server(tmp_path, max_restarts=0, on_failed=failures.append)
    with server:
        os.killpg(server._proc.pid, signal.SIGKILL)
        for _ in range(400):
            if failures:
                break
            time.sleep(0.05)
    assert len(failures) == 1 and "not restarted again" in failures[0] and server.failed == failures[0]


def test_a_kill_stops_a_server_still_loading(tmp_path):
    """`eagleops kill` during a slow vLLM start must not wait minutes for it."""
    from eagleops.pipeline.training.context import StageContext, StageKilled, serving

    ctx = StageContext("eval")
    hang = SupervisedServer("slow", lambda port: [sys.executable, "-c", "import time; time.sleep(600)"], log_path=tmp_path / "slow.log")
    threading.Timer(1.0, ctx.kill).start()
    with pytest.raises(StageKilled), serving(hang, ctx):
        pass
    with pytest.raises(ProcessLookupError):
        os.killpg(hang._proc.pid, 0)
