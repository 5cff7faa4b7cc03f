"""Faults a hostile operator, co-tenant or server brings: full disks, dead endpoints, poisoned
rows, a runtime dir someone else made, keys echoed back, absurd numbers, broken pipes, a flooded
control socket. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from eagleops.headless import run_headless
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.generate import store as store_module
from eagleops.pipeline.generate.client import ChatClient, TokenCounter
from eagleops.pipeline.generate.endpoints import EndpointPool
from eagleops.pipeline.protocol.control import (
    ControlClient,
    ControlError,
    ControlServer,
    checked_runtime_dir,
    find_sockets,
    socket_path_for,
)
from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, LogEvent
from eagleops.pipeline.servers.supervisor import free_port
from tests.conftest import engine_ticks, make_config, read_jsonl, write_jsonl

from .test_generate import prompts, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _check_output(out: Path, name: str, expected_ids: set[str]) -> list[dict]:
    """Every line whole, each expected id exactly once, the manifest's totals equal to the file."""
    data = (out / name / "data.jsonl").read_bytes()
    assert not data or data.endswith(b"\n")
    records = [json.loads(line) for line in data.splitlines()]
    counts = Counter(r["id"] for r in records)
    assert set(counts) == expected_ids and max(counts.values()) == 1
    manifest = json.loads((out / name / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == len(records)
    assert manifest["totals"]["tokens"] == sum(r["completion_tokens"] for r in records)
    assert manifest["committed"]["data"] == len(data)
    return records


# ---- 1. a failed write pauses the dataset, keeps its records, and resumes -----------------------


class _DiskFullFor:
    """os.pwrite for the store that writes half its bytes, then fails with ENOSPC, ``times`` times."""

    def __init__(self, times: int):
        self.left = times
        self.real = os.pwrite

    def __call__(self, fd, data, offset):
        if self.left > 0:
            self.left -= 1
            self.real(fd, bytes(data[: max(1, len(data) // 2)]), offset)  # a partial line lands on disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data, offset)


async def test_a_failed_write_pauses_the_dataset_and_nothing_is_lost_or_doubled(tmp_path, fault_server, monkeypatch):
    disk = _DiskFullFor(times=4)
    monkeypatch.setattr(store_module.os, "pwrite", disk)
    source = write_jsonl(tmp_path / "a.jsonl", prompts(300, "[[tokens:5]] [[delay:0.01]]", prefix="full"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=8)
    engine = Engine(config)
    sub = engine.subscribe()
    summary = await engine.run()
    events = [e async for e in sub]
    paused = [e for e in events if isinstance(e, DatasetProgress) and e.state == DatasetState.PAUSED]
    assert paused and "cannot save" in paused[0].reason and "No space left on device" in paused[0].reason
    errors = [e.message for e in events if isinstance(e, LogEvent) and e.level == "error"]
    assert len(errors) == 1 and "finished records in memory, retrying" in errors[0]  # once, not once per try
    assert any("saving again" in e.message for e in events if isinstance(e, LogEvent))
    assert disk.left == 0 and summary.ok and summary.datasets[0].samples == 300
    _check_output(tmp_path / "out", "A", {f"full{i}" for i in range(300)})


async def test_a_full_disk_ends_with_nothing_saved_past_a_partial_line_when_killed(tmp_path, fault_server, monkeypatch):
    disk = _DiskFullFor(times=10**6)  # never comes back
    source = write_jsonl(tmp_path / "a.jsonl", prompts(200, "[[tokens:5]] [[delay:0.01]]", prefix="dead"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=8)
    fault_server.reset()
    engine = Engine(config, progress_interval_s=0.1)
    await engine.open()
    monkeypatch.setattr(store_module.os, "pwrite", disk)
    task = asyncio.create_task(engine.run())
    runner = engine.generate.runners["A"]
    await wait_for(lambda: runner.storage_error is not None and runner.in_flight == 0)
    held, asked = runner.store.buffered(), fault_server.stats()["requests"]
    await engine_ticks(engine, 3)
    # paused: no new requests, so what is held in memory stays what was finished when the disk filled
    assert runner.store.buffered() == held < 200 and fault_server.stats()["requests"] == asked
    engine.kill()
    summary = await task
    assert summary.killed
    monkeypatch.undo()
    assert (tmp_path / "out" / "A" / "data.jsonl").read_bytes() == b""  # the partial lines were cut back
    again = await Engine(config).run()  # the disk is back: a resume makes everything, once
    assert again.ok
    _check_output(tmp_path / "out", "A", {f"dead{i}" for i in range(200)})


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


async def test_a_real_full_disk_pauses_and_resumes_when_space_comes_back(tmp_path, fault_server):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "512k"):
        pytest.skip("mounting a tmpfs needs root (the injected-ENOSPC tests cover the logic)")
    try:
        source = write_jsonl(tmp_path / "a.jsonl", prompts(400, "[[tokens:40]] [[delay:0.005]]", prefix="tmpfs"))
        config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=8)
        config = type(config)(**{**config.__dict__, "output_dir": disk / "out"})
        engine = Engine(config)
        await engine.open()
        ballast = disk / "ballast"
        with open(ballast, "wb") as f:  # fill what is left but ~40 KB: the run fills the rest
            with contextlib.suppress(OSError):
                f.write(b"\0" * (shutil.disk_usage(disk).free - 40_000))
        task = asyncio.create_task(engine.run())
        runner = engine.generate.runners["A"]
        await wait_for(lambda: runner.storage_error is not None, timeout=60)
        assert runner.state == DatasetState.PAUSED
        ballast.unlink()  # space comes back
        summary = await asyncio.wait_for(task, 120)
        assert summary.ok
        _check_output(disk / "out", "A", {f"tmpfs{i}" for i in range(400)})
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ---- 2. failover: a dead endpoint is benched and its requests go to a healthy one ----------------


async def test_retries_go_to_a_healthy_endpoint_and_a_dead_one_is_benched(tmp_path, fault_server):
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: refused at once
    source = write_jsonl(tmp_path / "a.jsonl", prompts(300, "[[tokens:3]]", prefix="fo"))
    config = make_config(
        tmp_path,
        "",
        [{"name": "A", "path": str(source), "token_budget": "1M"}],
        concurrency=16,
        retry={},  # the defaults: 6 attempts, 0.5 s first backoff
        endpoints=[{"base_url": dead, "model": "m"}, {"base_url": fault_server.base_url, "model": "m"}],
    )
    engine = Engine(config)
    sub = engine.subscribe()
    summary = await engine.run()
    logs = [e.message for e in [e async for e in sub] if isinstance(e, LogEvent)]
    assert summary.ok and summary.datasets[0].samples == 300 and summary.datasets[0].failures == 0
    assert any("benched" in m and "others take its requests" in m for m in logs)
    dead_stats, live_stats = engine.endpoint_stats()
    assert dead_stats.errors < 60 and live_stats.requests == 300  # a few probes, not one per record


def test_retry_after_is_capped_by_max_delay(tmp_path):
    config = make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "A", "path": str(tmp_path / "a.jsonl"), "token_budget": 1}])
    client = ChatClient(None, EndpointPool(config.endpoints), config.sampling, config.retry, TokenCounter(None))  # type: ignore[arg-type]
    assert client.backoff(1, 86400.0) <= config.retry.max_delay_s


# ---- 3. and 6. every unusable row reaches failed.jsonl; duplicate ids are two rows --------------


async def test_poisoned_rows_fail_alone_with_file_and_line(tmp_path, fault_server, monkeypatch):
    lines = [json.dumps({"id": "ok0", "prompt": "fine zero"}), '{"id": "sur", "prompt": "emoji half \\ud83d"}']
    lines += [
        '{"id": "\\udc00", "prompt": "bad id"}',
        json.dumps({"id": "boom", "prompt": "explodes"}),
        json.dumps({"id": "ok1", "prompt": "one"}),
    ]
    source = tmp_path / "a.jsonl"
    source.write_text("\n".join(lines) + "\n")
    real_complete = ChatClient.complete

    async def complete(self, messages, **kwargs):
        if "explodes" in messages[-1]["content"]:
            raise KeyError("something nobody foresaw")
        return await real_complete(self, messages, **kwargs)

    monkeypatch.setattr(ChatClient, "complete", complete)
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}])
    for _ in range(2):  # and a resume does not die on them either
        summary = await Engine(config).run()
        assert summary.ok, summary.datasets
    failed = read_jsonl(tmp_path / "out" / "A" / "failed.jsonl")
    by_line = {f["source_line"]: f for f in failed}
    assert set(by_line) == {2, 3, 4}
    assert by_line[2]["field"] == "prompt" and "lone surrogate" in by_line[2]["reason"] and "a.jsonl:2" in by_line[2]["reason"]
    assert by_line[3]["field"] == "id"
    assert by_line[4]["kind"] == "request" and "KeyError" in by_line[4]["reason"]
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "A" / "data.jsonl")] == ["ok0", "ok1"]


async def test_a_row_sharing_an_id_with_a_finished_one_is_not_skipped_on_resume(tmp_path):
    from eagleops.pipeline.generate.store import DatasetStore
    from eagleops.pipeline.sources import Prompt

    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    rows = [
        Prompt(pid, ({"role": "user", "content": pid},), offset, offset + 10, offset // 10 + 1)
        for pid, offset in (("a", 0), ("dup", 10), ("dup", 20))
    ]
    store = DatasetStore(tmp_path / "out", "d", source)
    store.open()
    for row in rows:
        store.dispatched(row)
    store.advanced(30, 3)
    store.add_record(rows[1], {"id": "dup", "source_offset": 10, "completion_tokens": 1})  # the first "dup" is done
    await store.flush()  # ... and the run dies with "a" and the second "dup" in flight
    again = DatasetStore(tmp_path / "out", "d", source)
    again.open()
    assert again.skip(rows[1]) and not again.skip(rows[2]) and not again.skip(rows[0])


async def test_duplicate_ids_are_two_rows_in_a_clean_run_and_after_a_kill(tmp_path, fault_server):
    rows = prompts(60, "[[tokens:4]] [[delay:0.02]]", prefix="dup")
    rows[40]["id"] = rows[50]["id"] = rows[5]["id"] = "shared"
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=4)
    engine = Engine(config)
    task = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].store.durable.samples >= 10)
    engine.kill()
    await task
    assert (await Engine(config).run()).ok
    records = read_jsonl(tmp_path / "out" / "A" / "data.jsonl")
    assert sorted(r["source_line"] for r in records) == list(range(1, 61))
    assert Counter(r["id"] for r in records)["shared"] == 3


# ---- 4. the runtime dir must be ours, private, and no symlink -----------------------------------


def _fresh_runtime_dir(monkeypatch) -> Path:
    folder = Path("/tmp") / f"eo-rt-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("EAGLEOPS_RUNTIME_DIR", str(folder))
    return folder


async def test_a_runtime_dir_someone_else_prepared_is_refused(tmp_path, monkeypatch):
    folder = _fresh_runtime_dir(monkeypatch)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    try:
        folder.symlink_to(target)  # a co-tenant points our dir at theirs (or at one of ours)
        with pytest.raises(ControlError, match="symbolic link"):
            await ControlServer(None, socket_path_for("r", tmp_path)).start()  # type: ignore[arg-type]
        assert (target.stat().st_mode & 0o777) == 0o755 and not list(target.iterdir())  # not chmodded, no socket
        folder.unlink()
        folder.mkdir(mode=0o755)
        os.chmod(folder, 0o755)
        with pytest.raises(ControlError, match="mode 0755"):
            checked_runtime_dir(create=True)
        if os.geteuid() == 0:  # only root can hand a dir to another user here
            os.chmod(folder, 0o700)
            os.chown(folder, 4242, 4242)
            with pytest.raises(ControlError, match="owned by uid 4242"):
                checked_runtime_dir(create=True)
            with pytest.raises(ControlError, match="owned by uid 4242"):
                find_sockets()  # `eagleops kill` would ask a socket the other user planted
    finally:
        if folder.is_symlink():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)


async def test_a_socket_not_ours_is_not_talked_to(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can make a socket owned by another user here")
    path = tmp_path / "fake.sock"
    fake = socket.socket(socket.AF_UNIX)
    fake.bind(str(path))
    fake.listen()
    os.chown(path, 4242, 4242)
    try:
        with pytest.raises(ControlError, match="not a socket of ours"):
            await ControlClient(path).status()
    finally:
        fake.close()


# ---- 5. keys: redacted before truncation, in escaped forms, in what we store ---------------------


async def test_keys_are_redacted_whatever_the_server_does_with_them(tmp_path, fault_server, monkeypatch, capsys):
    secret = "sk-or-v1-4f2a9c0e7b6d5a43-LEAK"
    monkeypatch.setenv("EAGLEOPS_TEST_KEY", secret)
    rows = [
        {"id": "late", "prompt": "a [[fault:echo-auth-late]]"},
        {"id": "escaped", "prompt": "b [[fault:echo-auth-json]]"},
        {"id": "echoed", "prompt": "c [[fault:echo-auth-200]]"},
        {"id": "basic", "prompt": "d " + base64.b64encode(f"user:{secret}".encode()).decode()},  # our own prompt, echoed
    ]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    config = make_config(
        tmp_path,
        "",
        [{"name": "A", "path": str(source), "token_budget": "1M"}],
        endpoints=[{"base_url": fault_server.base_url, "model": "m", "api_key_env": "EAGLEOPS_TEST_KEY"}],
    )
    printed, as_json = io.StringIO(), io.StringIO()
    await run_headless(config, out=printed, serve_socket=False)
    await run_headless(config, as_json=True, out=as_json, serve_socket=False)
    everything = printed.getvalue() + as_json.getvalue() + capsys.readouterr().out
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            everything += path.read_text(errors="replace")
    failed = {f["id"]: f["reason"] for f in read_jsonl(tmp_path / "out" / "A" / "failed.jsonl")}
    assert "bad key: Bearer ***" in failed["late"] and "***" in failed["escaped"]
    assert "you sent Bearer ***" in read_jsonl(tmp_path / "out" / "A" / "data.jsonl")[0]["conversations"][-1]["content"]
    for form in (secret, secret[:-1], secret.replace("-", "\\u002d"), secret[:12]):
        assert form not in everything, form
    assert base64.b64encode(f"user:{secret}".encode()).decode()[8:30] not in everything


# ---- 9. a server's numbers are checked, and its replies capped --------------------------------


async def test_absurd_server_numbers_are_not_trusted(tmp_path, fault_server):
    rows = [
        {"id": "huge", "prompt": "a [[tokens:5]] [[usage:completion_tokens=1000000000000000]]"},
        {"id": "negative", "prompt": "b [[usage:prompt_tokens=-5]]"},
        {"id": "nan", "prompt": "c [[usage:cost=NaN]]"},
        {"id": "big", "prompt": "d [[bigreply:3]]"},
        {"id": "fine", "prompt": "e [[tokens:7]]"},
    ]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    retry = {"base_delay_s": 0.01, "max_delay_s": 0.05, "max_attempts": 2, "timeout_s": 30, "max_reply_mb": 1}
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": 1000}], retry=retry)
    summary = await Engine(config).run()
    assert summary.datasets[0].state == DatasetState.DONE and summary.datasets[0].tokens < 1000
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "A" / "data.jsonl")}
    assert records["huge"]["completion_tokens"] < 64 and records["huge"]["usage_source"] != "server"
    assert records["negative"]["prompt_tokens"] is None and records["nan"]["cost"] is None
    (failure,) = read_jsonl(tmp_path / "out" / "A" / "failed.jsonl")
    assert failure["id"] == "big" and "limit (retry.max_reply_mb)" in failure["reason"]
    manifest = json.loads((tmp_path / "out" / "A" / "manifest.json").read_text())  # strict JSON: no bare NaN
    assert manifest["totals"]["prompt_tokens"] >= 0


# ---- 10. a reader that goes away ------------------------------------------------------------------


def test_json_into_head_exits_cleanly(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(200, "[[tokens:3]]", prefix="pipe"))
    run = tmp_path / "run.toml"
    run.write_text(
        f'name = "pipe"\noutput_dir = "out"\nflush_interval_s = 0.05\n[[endpoints]]\nbase_url = "{fault_server.base_url}"\nmodel = "m"\n'
        f'[[datasets]]\nname = "A"\npath = "{source}"\ntoken_budget = "1M"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shell = f"{sys.executable} -m eagleops run {run} --json | head -3 >/dev/null; exit ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert len(read_jsonl(tmp_path / "out" / "A" / "data.jsonl")) == 200  # the run went on to the end


# ---- 11. the control socket under abuse, and the lock ---------------------------------------------


async def test_control_socket_survives_huge_lines_and_crowds(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(50, "[[tokens:3]] [[delay:0.05]]", prefix="sock"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=1)
    engine = Engine(config)
    await engine.open()
    server = await engine.serve_socket()
    assert server is not None
    try:
        reader, writer = await asyncio.open_unix_connection(str(server.path))
        writer.write(b"x" * (5 << 20))  # 5 MB without a newline (not drained: the server stops reading)
        answer = json.loads(await reader.readline())
        assert answer["ok"] is False and "over" in answer["message"]
        writer.close()

        async def ask() -> bool:
            client = ControlClient(server.path)
            try:
                return any(isinstance(e, DatasetProgress) for e in await client.status())
            finally:
                await client.close()

        answers = await asyncio.gather(*(ask() for _ in range(500)), return_exceptions=True)
        assert answers.count(True) == 500, Counter(type(a).__name__ for a in answers)
    finally:
        await server.close()
        await engine.run()  # releases the lock


async def test_a_refused_second_engine_leaves_the_lock_holders_pid(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(5))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}])
    first = Engine(config)
    await first.open()
    with pytest.raises(Exception, match=f"pid {os.getpid()}"):
        await Engine(config).open()
    assert (tmp_path / "out" / ".lock").read_text().strip() == str(os.getpid())
    await first.run()


def test_a_dataset_path_that_is_a_folder_without_data_exits_2(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("no rows here")
    run = tmp_path / "run.toml"
    run.write_text(
        'name = "d"\n[[endpoints]]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n[[datasets]]\nname = "A"\npath = "dir"\ntoken_budget = 5\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and "datasets[0].path" in done.stderr and "no data files" in done.stderr


# ---- the storm: kill -9 again and again while the faults above happen -----------------------------


def test_a_storm_of_kills_and_faults_loses_and_duplicates_nothing(tmp_path):
    """A few rounds here; ``EAGLEOPS_STORM_KILLS=100`` (or ``python bench/fault_storm.py``) for the full storm."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fault_storm", ROOT / "bench" / "fault_storm.py")
    assert spec is not None and spec.loader is not None
    storm = sys.modules["fault_storm"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(storm)
    result = storm.run_storm(tmp_path, kills=int(os.environ.get("EAGLEOPS_STORM_KILLS", "6")), seed=7, say=lambda _: None)
    assert result.kills >= 3, result
    assert result.clean, result
    assert result.lost == 0 and result.duplicated == 0 and result.key_leaks == 0


def test_a_day_of_failures_does_not_overflow_the_backoff():
    from eagleops.pipeline.config import EndpointConfig

    pool = EndpointPool((EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m"),), base_bench_s=0.5, max_bench_s=30)
    endpoint = pool.endpoints[0]
    for _ in range(3000):  # a probe every 30 s for a day: 2**n must not become a float overflow
        pool.failed(endpoint, "connection refused")
    assert 0 < endpoint.benched_until - pool.clock() <= 30


def test_requests_failing_together_are_one_failure_and_do_not_bench_the_server():
    """A server that stalls drops every request in flight at once (vLLM's keep-alive timers fire
    late, bench/RESULTS.md, issue 24): that is one failure, not 40, so the endpoint is not benched,
    while failures of requests sent one after another still bench a dead server."""
    from eagleops.pipeline.config import EndpointConfig

    now = [100.0]
    pool = EndpointPool(
        (EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m"),), base_bench_s=0.5, max_bench_s=30, clock=lambda: now[0]
    )
    endpoint = pool.endpoints[0]
    now[0] = 105.0
    for _ in range(40):  # all sent at 100, all dropped at 105
        pool.failed(endpoint, "connection error: ServerDisconnectedError", sent_at=100.0)
    assert endpoint.errors == 40 and endpoint.failures_in_a_row == 1 and not endpoint.benched(now[0])
    for _ in range(2):  # their retries, sent after the failure, fail too: the server is down
        now[0] += 1
        sent = now[0]
        now[0] += 1
        pool.failed(endpoint, "connection refused", sent_at=sent)
        pool.failed(endpoint, "connection refused", sent_at=sent)  # its twin of the same round
    assert endpoint.failures_in_a_row == 3 and endpoint.benched(now[0])
    assert endpoint.benched_until - now[0] == pytest.approx(0.5)


async def test_a_manifest_that_could_not_be_written_is_written_by_the_next_flush(tmp_path, monkeypatch):
    from eagleops.pipeline.generate.store import DatasetStore, WriteFailed

    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 4)
    store = DatasetStore(tmp_path / "out", "d", source)
    store.open()
    store.budget.live = 12345  # e.g. a live budget change, nothing else to save
    real = store_module.write_json_atomic
    calls = {"n": 0}

    def full_once(path, payload):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, payload)

    monkeypatch.setattr(store_module, "write_json_atomic", full_once)
    with pytest.raises(WriteFailed):
        await store.flush(force_manifest=True)
    assert store.unsaved()  # so the flusher comes back for it
    await store.flush()
    assert json.loads(store.manifest_path.read_text())["budget_override"] == 12345 and not store.unsaved()


async def test_a_dataset_killed_while_the_disk_is_full_resumes_without_duplicates(tmp_path, fault_server, monkeypatch):
    from eagleops.pipeline.protocol.events import Kill, Resume

    source = write_jsonl(tmp_path / "a.jsonl", prompts(120, "[[tokens:5]] [[delay:0.01]]", prefix="kfull"))
    other = write_jsonl(tmp_path / "b.jsonl", prompts(40, "[[tokens:5]] [[delay:0.01]]", prefix="kother"))
    datasets = [{"name": "A", "path": str(source), "token_budget": "1M"}, {"name": "B", "path": str(other), "token_budget": "1M"}]
    config = make_config(tmp_path, fault_server.base_url, datasets, concurrency=4)  # B keeps the run alive while A is killed
    engine = Engine(config)
    await engine.open()
    disk = _DiskFullFor(times=10**6)
    monkeypatch.setattr(store_module.os, "pwrite", disk)
    task = asyncio.create_task(engine.run())
    runner = engine.generate.runners["A"]
    await wait_for(
        lambda: runner.storage_error is not None and runner.in_flight == 0 and engine.generate.runners["B"].storage_error is not None
    )
    await engine.execute(Kill("A"))
    assert runner.store.buffered() == 0  # what could not be saved is dropped, to be made again
    monkeypatch.undo()  # the disk is back
    await engine.execute(Resume("A"))
    summary = await asyncio.wait_for(task, 60)
    assert summary.ok
    _check_output(tmp_path / "out", "A", {f"kfull{i}" for i in range(120)})
    _check_output(tmp_path / "out", "B", {f"kother{i}" for i in range(40)})


def test_a_placeholder_key_is_not_scrubbed_from_generated_text(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEOPS_TEST_KEY", "EMPTY")  # what vLLM setups usually pass
    config = make_config(
        tmp_path, "", [{"name": "A", "path": str(tmp_path / "a.jsonl"), "token_budget": 1}],
        endpoints=[{"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "EAGLEOPS_TEST_KEY"}],
    )  # fmt: skip
    engine = Engine(config)
    assert engine.generate.shared.redact_data.scrub({"text": "the EMPTY set"}) == {"text": "the EMPTY set"}
    assert engine.redact("bad key EMPTY") == "bad key ***"  # logs still hide it
