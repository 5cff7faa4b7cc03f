"""The generate stage against a real fault-injecting HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections import Counter

import pytest

from eagleops.headless import run_headless
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.protocol.control import ControlClient, ControlServer, socket_path_for
from eagleops.pipeline.protocol.events import (
    DatasetProgress,
    DatasetState,
    Kill,
    LogEvent,
    Pause,
    Resume,
    SetBudget,
    StopReason,
    event_from_json,
)
from tests.conftest import engine_ticks, make_config, read_jsonl, write_jsonl


def prompts(n: int, directive: str = "", prefix: str = "q") -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": f"{prefix} number {i} {directive}"} for i in range(n)]


async def wait_for(predicate, timeout: float = 20.0, step: float = 0.01):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(step)


def ids_of(path) -> list[str]:
    return [r["id"] for r in read_jsonl(path)]


async def test_budget_stops_issuing_and_overshoot_is_bounded(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(500, "[[tokens:40]] [[delay:0.02]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": 2000}], concurrency=16)
    summary = await Engine(config).run()
    (progress,) = summary.datasets
    assert progress.state == DatasetState.DONE and progress.reason.startswith("budget reached")
    assert progress.tokens >= 2000
    # Everything accepted past the budget was already in flight when it was reached.
    assert progress.overshoot <= 16 * 64
    records = read_jsonl(tmp_path / "out" / "A" / "data.jsonl")
    assert sum(r["completion_tokens"] for r in records) == progress.tokens
    assert len(records) == progress.samples < 500
    # SpecForge reads `conversations` of role/content turns.
    assert records[0]["conversations"][-1]["role"] == "assistant"
    assert records[0]["conversations"][0] == {"role": "user", "content": records[0]["conversations"][0]["content"]}


async def test_a_dataset_at_budget_is_skipped_at_once_on_restart(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(100, "[[tokens:10]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": 200}])
    first = await Engine(config).run()
    fault_server.reset()
    second = await Engine(config).run()
    assert second.datasets[0].state == DatasetState.DONE
    assert second.datasets[0].samples == first.datasets[0].samples
    assert fault_server.stats()["requests"] == 0


async def test_max_samples_caps_a_dataset(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(100))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M", "max_samples": 7}])
    summary = await Engine(config).run()
    assert summary.datasets[0].samples == 7
    assert summary.datasets[0].reason == "sample cap reached"


async def test_retries_faults_and_records_permanent_failures(tmp_path, fault_server):
    rows = [
        {"id": "ok", "prompt": "plain"},
        {"id": "e500", "prompt": "x [[fault:500x2]]"},
        {"id": "e429", "prompt": "x [[fault:429x1]]"},
        {"id": "reset", "prompt": "x [[fault:resetx1]]"},
        {"id": "malformed", "prompt": "x [[fault:malformedx1]]"},
        {"id": "nousage", "prompt": "x [[fault:nousage]] [[tokens:12]]"},
        {"id": "forever", "prompt": "x [[fault:503]]"},
        {"id": "badreq", "prompt": "x [[fault:400]]"},
        "{broken",
        {"id": "after", "prompt": "still runs after a bad line"},
    ]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}])
    engine = Engine(config)
    sub = engine.subscribe()
    summary = await engine.run()
    logs = [e.message async for e in sub if isinstance(e, LogEvent)]
    out = tmp_path / "out" / "A"
    done = {r["id"]: r for r in read_jsonl(out / "data.jsonl")}
    failed = {r["id"]: r for r in read_jsonl(out / "failed.jsonl")}
    assert set(done) == {"ok", "e500", "e429", "reset", "malformed", "nousage", "after"}
    assert done["e500"]["attempts"] == 3 and done["e429"]["attempts"] == 2
    assert done["nousage"]["usage_source"] == "estimate" and done["nousage"]["completion_tokens"] > 0
    assert done["ok"]["usage_source"] == "server"
    assert set(failed) == {"forever", "badreq", "line:9"}
    assert "HTTP 503" in failed["forever"]["reason"] and failed["forever"]["attempts"] == 4
    assert "HTTP 400" in failed["badreq"]["reason"] and failed["badreq"]["attempts"] == 1
    assert failed["line:9"]["reason"] == f"{source}:9: <json>: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    assert any(f"{source}:9:" in m for m in logs)
    assert summary.datasets[0].failures == 2 and summary.datasets[0].bad_lines == 1


async def test_missing_usage_falls_back_to_the_local_tokenizer(tmp_path, fault_server, tiny_model):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": "n", "prompt": "x [[fault:nousage]] [[tokens:9]]"}])
    config = make_config(
        tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": 100}], tokenizer=str(tiny_model)
    )
    await Engine(config).run()
    (record,) = read_jsonl(tmp_path / "out" / "A" / "data.jsonl")
    from transformers import AutoTokenizer

    expected = len(AutoTokenizer.from_pretrained(str(tiny_model)).encode(record["conversations"][-1]["content"], add_special_tokens=False))
    assert record["usage_source"] == "tokenizer" and record["completion_tokens"] == expected


async def test_paid_api_spend_is_counted_and_projected(tmp_path, fault_server):
    from eagleops.console.report import status_line

    source = write_jsonl(tmp_path / "a.jsonl", prompts(10, "[[tokens:50]] [[cost:0.002]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": 1000}], concurrency=1)
    (progress,) = (await Engine(config).run()).datasets
    assert progress.cost == pytest.approx(0.002 * progress.samples)
    # so far / when it stops: it has stopped, so nothing more is to come (issue 20: not the price times the budget)
    assert f"spend ${progress.cost:.2f}/${progress.cost:.2f}" in status_line(progress)


async def test_live_budget_up_resumes_and_down_stops_issuing(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(400, "[[tokens:20]] [[delay:0.03]]"))
    slow = write_jsonl(tmp_path / "slow.jsonl", prompts(20, "[[tokens:1]] [[delay:0.5]]", "slow"))
    datasets = [{"name": "A", "path": str(source), "token_budget": 200}, {"name": "Slow", "path": str(slow), "token_budget": "1M"}]
    config = make_config(tmp_path, fault_server.base_url, datasets, concurrency=5)
    engine = Engine(config)
    run = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].state == DatasetState.DONE)
    before = engine.generate.runners["A"].store.accepted.tokens
    ack = await engine.execute(SetBudget("A", 2000))
    assert ack.ok and "resumed" in ack.message
    await wait_for(lambda: engine.generate.runners["A"].store.accepted.tokens > 600)
    ack = await engine.execute(SetBudget("A", 700))
    assert ack.ok
    await engine.execute(Kill("Slow"))
    summary = await run
    progress = summary.datasets[0]
    assert before >= 200
    assert progress.budget == 700
    assert 700 <= progress.tokens <= 700 + 5 * 64  # only what was in flight when lowered
    manifest = json.loads((tmp_path / "out" / "A" / "manifest.json").read_text())
    assert manifest["budget_override"] == 700  # a restart keeps the live budget


async def test_lowering_with_cancel_flag_cancels_in_flight(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": "fast", "prompt": "f [[tokens:50]]"}] + prompts(20, "[[fault:stall]]", "s"))
    config = make_config(
        tmp_path,
        fault_server.base_url,
        [{"name": "A", "path": str(source), "token_budget": 100000}],
        concurrency=8,
        cancel_in_flight_over_budget=True,
    )
    fault_server.reset()
    engine = Engine(config)
    run = asyncio.create_task(engine.run())
    await wait_for(
        lambda: (
            "A" in engine.generate.runners
            and engine.generate.runners["A"].store.accepted.samples == 1
            and engine.generate.runners["A"].in_flight == 8
        )
    )
    ack = await engine.execute(SetBudget("A", 10))
    assert "cancelled 8 in flight" in ack.message
    summary = await asyncio.wait_for(run, 10)
    assert summary.datasets[0].state == DatasetState.DONE
    await wait_for(lambda: fault_server.stats()["disconnects"] == 8, timeout=5)


async def test_pause_lets_in_flight_finish_and_resume_continues(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(200, "[[tokens:10]] [[delay:0.05]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=4)
    engine = Engine(config, progress_interval_s=0.1)
    run = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].store.accepted.samples >= 8)
    await engine.execute(Pause("A"))
    runner = engine.generate.runners["A"]
    await wait_for(lambda: runner.in_flight == 0)
    paused_at = runner.store.accepted.samples
    await engine_ticks(engine, 3)  # three progress reports later, nothing moved
    assert runner.store.accepted.samples == paused_at and runner.state == DatasetState.PAUSED
    await engine.execute(Resume("A"))
    summary = await asyncio.wait_for(run, 30)
    assert summary.datasets[0].samples == 200
    assert Counter(ids_of(tmp_path / "out" / "A" / "data.jsonl")).most_common(1)[0][1] == 1


async def test_kill_cancels_in_flight_and_the_server_sees_it(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(3, "[[tokens:5]]", "ok") + prompts(30, "[[fault:stall]]", "stall"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=6)
    fault_server.reset()
    engine = Engine(config)
    run = asyncio.create_task(engine.run())
    await wait_for(lambda: fault_server.stats()["in_flight"] == 6 and engine.generate.runners["A"].store.accepted.samples == 3)
    await engine.execute(Kill())
    summary = await asyncio.wait_for(run, 5)
    assert summary.killed and summary.datasets[0].state == DatasetState.KILLED
    await wait_for(lambda: fault_server.stats()["disconnects"] == 6, timeout=5)
    assert fault_server.stats()["in_flight"] == 0
    # finished work was kept; the cancelled records are redone on resume
    assert sorted(ids_of(tmp_path / "out" / "A" / "data.jsonl")) == ["ok0", "ok1", "ok2"]
    manifest = json.loads((tmp_path / "out" / "A" / "manifest.json").read_text())
    assert manifest["watermark"]["lines"] == 3


async def test_kill_one_dataset_leaves_the_others_running(tmp_path, fault_server):
    a = write_jsonl(tmp_path / "a.jsonl", prompts(20, "[[fault:stall]]", "a"))
    b = write_jsonl(tmp_path / "b.jsonl", prompts(50, "[[tokens:5]] [[delay:0.01]]", "b"))
    config = make_config(
        tmp_path,
        fault_server.base_url,
        [{"name": "A", "path": str(a), "token_budget": "1M"}, {"name": "B", "path": str(b), "token_budget": "1M"}],
        concurrency=8,
    )
    engine = Engine(config)
    run = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].in_flight > 0)
    ack = await engine.execute(Kill("A"))
    assert ack.ok
    summary = await asyncio.wait_for(run, 20)
    states = {d.name: d for d in summary.datasets}
    assert states["A"].state == DatasetState.KILLED
    assert states["B"].state == DatasetState.DONE and states["B"].samples == 50
    assert not summary.killed


async def test_endpoints_are_load_balanced(tmp_path, fault_server, tmp_path_factory):
    from eagleops.pipeline.servers.launch import start_server

    folder = tmp_path_factory.mktemp("second")
    with start_server(["eagleops.pipeline.testservers.fault", "--tokens", "5"], folder / "port", log_path=folder / "log") as port:
        source = write_jsonl(tmp_path / "a.jsonl", prompts(60, "[[delay:0.02]]"))
        endpoints = [
            {"base_url": fault_server.base_url, "model": "m"},
            {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m2", "max_concurrency": 2},
        ]
        config = make_config(tmp_path, "", [{"name": "A", "path": str(source), "token_budget": "1M"}], endpoints=endpoints, concurrency=8)
        await Engine(config).run()
    used = Counter(r["endpoint"] for r in read_jsonl(tmp_path / "out" / "A" / "data.jsonl"))
    assert len(used) == 2 and all(n > 5 for n in used.values())
    models = {r["endpoint"]: r["model"] for r in read_jsonl(tmp_path / "out" / "A" / "data.jsonl")}
    assert models[f"http://127.0.0.1:{port}/v1"] == "m2"


async def test_the_api_key_never_reaches_outputs_or_logs(tmp_path, fault_server, monkeypatch, capsys):
    secret = "sk-test-ZX81-do-not-leak"
    monkeypatch.setenv("EAGLEOPS_TEST_KEY", secret)
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": "leak", "prompt": "x [[fault:echo-auth]]"}, {"id": "fine", "prompt": "y"}])
    config = make_config(
        tmp_path,
        "",
        [{"name": "A", "path": str(source), "token_budget": "1M"}],
        endpoints=[{"base_url": fault_server.base_url, "model": "m", "api_key_env": "EAGLEOPS_TEST_KEY"}],
    )
    import io

    printed = io.StringIO()
    json_out = io.StringIO()
    await run_headless(config, out=printed, serve_socket=False)
    await run_headless(config, as_json=True, out=json_out, serve_socket=False)
    failed = (tmp_path / "out" / "A" / "failed.jsonl").read_text()
    assert "bad key: Bearer ***" in failed  # the server did echo it: we redacted it
    everything = failed + printed.getvalue() + json_out.getvalue() + capsys.readouterr().out
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            everything += path.read_text(errors="replace")
    assert secret not in everything


async def test_control_socket_serves_commands_with_private_permissions(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(300, "[[tokens:10]] [[delay:0.02]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=2)
    engine = Engine(config)
    await engine.open()
    server = ControlServer(engine, socket_path_for(config.name, config.output_dir))
    await server.start()
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700
    run = asyncio.create_task(engine.run())
    client = ControlClient(server.path)
    stream = client.events()
    first = await anext(stream)
    assert first.kind == "run" and first.name == config.name  # the snapshot starts with the run as a whole
    ack = await client.send(Pause("A"))
    assert ack.ok and "paused A" in ack.message
    ack = await client.send(SetBudget("nope", 5))
    assert not ack.ok and "no dataset named 'nope'" in ack.message
    seen_paused = False
    async for event in stream:
        if isinstance(event, DatasetProgress) and event.state == DatasetState.PAUSED:
            seen_paused = True
            break
    assert seen_paused
    assert (await client.request({"cmd": "explode"}))["ok"] is False
    status = await client.status()
    assert any(isinstance(e, DatasetProgress) and e.name == "A" for e in status)
    ack = await client.send(SetBudget("A", 100))
    await client.send(Resume("A"))
    summary = await asyncio.wait_for(run, 20)
    assert summary.datasets[0].budget == 100 and summary.datasets[0].state == DatasetState.DONE
    await stream.aclose()
    await client.close()
    await server.close()
    assert not server.path.exists()


async def test_two_engines_cannot_share_an_output_dir(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(5))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}])
    first = Engine(config)
    await first.open()
    from eagleops.pipeline.engine import EngineError

    with pytest.raises(EngineError, match="another eagleops run"):
        await Engine(config).open()
    await first.run()


async def test_headless_lines_are_timestamped_short_and_only_what_changed(tmp_path, fault_server):
    import io
    import re

    fast = write_jsonl(tmp_path / "fast.jsonl", prompts(3, "[[tokens:5]]", prefix="hlf"))
    slow = write_jsonl(tmp_path / "slow.jsonl", prompts(40, "[[tokens:5]] [[delay:0.05]]", prefix="hls"))
    datasets = [
        {"name": "fast-one-with-a-rather-long-name", "path": str(fast), "token_budget": "1M"},
        {"name": "slow", "path": str(slow), "token_budget": "1M"},
    ]
    config = make_config(tmp_path, fault_server.base_url, datasets, concurrency=2, status_interval_s=0.1)
    out = io.StringIO()
    assert await run_headless(config, out=out, serve_socket=False) == 0
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    body = lines[: lines.index("summary:")]
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) or line.startswith(" " * 17) for line in body)
    fast_lines = [line for line in body if "fast-one-with~" in line]
    assert len(fast_lines) == len({line.split(" ", 1)[1] for line in fast_lines})  # never the same line twice
    assert sum("done" in line for line in fast_lines) == 1  # a finished dataset is not reprinted
    summary = lines[lines.index("summary:") + 1 :]
    assert len(summary) == 3 and summary[-1].lstrip().startswith("total") and "43 smp" in summary[-1]


async def test_retries_are_counted_per_dataset_not_logged_one_by_one(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(30, "[[fault:500x2]] [[tokens:3]]", prefix="digest"))
    config = make_config(
        tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], retry_log_interval_s=1.0
    )
    engine = Engine(config)
    sub = engine.subscribe()
    assert (await engine.run()).ok
    warnings = [e.message for e in [e async for e in sub] if isinstance(e, LogEvent) and e.level == "warning"]
    digests = [m for m in warnings if " in 1s (A " in m]
    assert digests and len(digests) < 20  # 60 retries, a few lines (however slow a loaded machine makes the run)
    assert all("HTTP 500 x" in m and "from http://127.0.0.1" in m and "e.g. digest" in m for m in digests)
    assert sum(int(m.split(" ", 1)[0]) for m in digests) == 60


async def test_eta_counts_the_end_of_the_source_not_only_the_budget(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(200, "[[tokens:5]] [[delay:0.02]]", prefix="eta"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1G"}], concurrency=4)
    engine = Engine(config)
    task = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].store.accepted.samples >= 60)
    eta = engine.generate.runners["A"].progress().eta_s
    await task
    assert eta is not None and eta < 60  # ~140 rows left at ~100/s, not 1G tokens at 500 tok/s (days)


async def test_an_attaching_console_gets_recent_history(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(200, "[[tokens:5]] [[delay:0.05]]", prefix="hist"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=2)
    engine = Engine(config)
    await engine.open()
    server = await engine.serve_socket()
    task = asyncio.create_task(engine.run())
    engine.log("warning", "something happened before anyone attached", "A")
    assert server is not None
    client = ControlClient(server.path)
    seen = []
    async for event in client.events():
        seen.append(event)
        if len(seen) >= 30 or (isinstance(event, LogEvent) and "before anyone" in event.message):
            break  # the snapshot comes first, the log's tail in it
    engine.kill()
    await task
    await server.close()
    assert any(isinstance(e, LogEvent) and "before anyone attached" in e.message for e in seen)


class RecordingHost:
    """A StageHost with no engine behind it: the generate stage needs nothing more."""

    def __init__(self):
        self.events: list = []
        self.lines: list[tuple[str, str]] = []

    def publish(self, event) -> None:
        self.events.append(event)

    def log(self, level: str, message: str, dataset: str | None = None) -> None:
        self.lines.append((level, message))

    def set_stage(self, name, status, detail: str = "") -> None:
        self.events.append((name, status))


async def test_a_live_budget_is_one_value_the_generate_stage_owns_without_an_engine(tmp_path):
    """Down the layers: stage -> runner -> its limits and its store; the change is durable and
    published, and a reopened stage starts from it, not from the run file."""
    from eagleops.pipeline.generate.stage import GenerateStage

    source = write_jsonl(tmp_path / "a.jsonl", prompts(3))
    config = make_config(tmp_path, "http://127.0.0.1:9", [{"name": "A", "path": str(source), "token_budget": 100}])
    host = RecordingHost()
    stage = GenerateStage(config, host, clock=lambda: 0.0)
    await stage.open()
    ack = await stage.execute(SetBudget("A", 5000))
    assert ack.ok and ack.message == "budget A: 100 -> 5k"
    runner = stage.runners["A"]
    assert runner.budget == runner.store.budget.tokens == 5000 and runner.admission.limits.budget is runner.store.budget
    assert [e.budget for e in host.events if isinstance(e, DatasetProgress)] == [5000]
    reopened = GenerateStage(config, RecordingHost(), clock=lambda: 0.0)
    await reopened.open()
    assert reopened.runners["A"].budget == 5000


async def test_a_dataset_stopped_by_its_budget_says_so_in_a_typed_reason(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", prompts(40, "[[tokens:10]]"))
    exhausted = write_jsonl(tmp_path / "b.jsonl", prompts(2, "[[tokens:10]]"))
    datasets = [{"name": "A", "path": str(source), "token_budget": 50}, {"name": "B", "path": str(exhausted), "token_budget": "1M"}]
    summary = await Engine(make_config(tmp_path, fault_server.base_url, datasets, concurrency=2)).run()
    by_name = {p.name: p for p in summary.datasets}
    assert by_name["A"].stopped_by == StopReason.BUDGET and by_name["A"].reason.startswith("budget reached")
    assert by_name["B"].stopped_by == StopReason.SOURCE_EXHAUSTED
    assert event_from_json(by_name["A"].to_json()) == by_name["A"]
