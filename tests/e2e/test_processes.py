"""Whole programs: kill -9 at random moments, the CLI against a headless run, the real model
server, and the README's demo command."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from eagleops.pipeline.servers.launch import start_server
from tests.conftest import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleops", *args], capture_output=True, text=True, env=_env(), timeout=120, **kwargs)


def _write_run(tmp_path: Path, base_url: str, datasets: list[tuple[str, Path, str]], *, concurrency: int = 8, extra: str = "") -> Path:
    text = f'name = "{tmp_path.name[:20]}"\noutput_dir = "out"\nconcurrency = {concurrency}\nflush_interval_s = 0.05\nstatus_interval_s = 0.5\n{extra}\n'
    text += "[sampling]\nmax_tokens = 64\n[retry]\nbase_delay_s = 0.01\nmax_delay_s = 0.1\nmax_attempts = 20\n"
    text += f'[[endpoints]]\nbase_url = "{base_url}"\nmodel = "m"\n'
    for name, path, budget in datasets:
        text += f'[[datasets]]\nname = "{name}"\npath = "{path}"\ntoken_budget = "{budget}"\n'
    run = tmp_path / "run.toml"
    run.write_text(text)
    return run


def _samples() -> int:
    """The running engine's samples so far, as `eagleops status --json` reports them."""
    events = [json.loads(line) for line in _cli("status", "--json").stdout.splitlines()]
    return sum(e["samples"] for e in events if e.get("type") == "dataset")


def _headless(run: Path) -> subprocess.Popen:
    """``eagleops run --no-tui`` in the background, its output readable by the test."""
    command = [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_9_repeatedly(run: Path, rng: random.Random, *, times: int, window: tuple[float, float]) -> int:
    """Start the run headless and kill -9 it a random moment later, again and again; the kills made."""
    kills = 0
    for _ in range(times):
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(*window))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    return kills


def test_kill_9_at_random_moments_loses_and_duplicates_nothing(tmp_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flaky")
    # random transient faults too: retries in flight when the kill lands
    argv = ["eagleops.pipeline.testservers.fault", "--tokens", "7", "--latency", "0.12", "--fault-rate", "0.15", "--seed", "3"]
    with start_server(argv, folder / "port", log_path=folder / "log") as port:
        rows = [{"id": f"a{i}", "prompt": f"alpha {i}"} for i in range(600)]
        rows[123] = "{torn source line"
        a = write_jsonl(tmp_path / "a.jsonl", rows)
        b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"beta {i}"} for i in range(400)])
        run = _write_run(tmp_path, f"http://127.0.0.1:{port}/v1", [("A", a, "1G"), ("B", b, "1G")], concurrency=24)
        kills = _kill_9_repeatedly(run, random.Random(11), times=12, window=(0.6, 2.0))  # imports take ~0.5s
        final = _cli("run", str(run), "--no-tui")
        assert final.returncode == 0, final.stderr + final.stdout
    assert kills >= 2
    for name, expected in (("A", {f"a{i}" for i in range(600) if i != 123}), ("B", None)):
        lines = (tmp_path / "out" / name / "data.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]  # every line whole
        ids = Counter(r["id"] for r in records)
        assert max(ids.values()) == 1, [k for k, v in ids.items() if v > 1][:5]
        if expected is not None:
            assert set(ids) == expected
        else:
            assert len(ids) == 400
        manifest = json.loads((tmp_path / "out" / name / "manifest.json").read_text())
        assert manifest["totals"]["samples"] == len(records)
        assert manifest["totals"]["tokens"] == sum(r["completion_tokens"] for r in records)
    failed = read_jsonl(tmp_path / "out" / "A" / "failed.jsonl")
    assert [f["id"] for f in failed] == ["line:124"]


def test_cli_steers_a_headless_run(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"p{i}", "prompt": f"x {i} [[tokens:10]] [[delay:0.05]]"} for i in range(400)])
    run = _write_run(tmp_path, fault_server.base_url, [("B3", source, "1M")], concurrency=2)
    proc = _headless(run)
    try:
        deadline = time.monotonic() + 30
        while True:
            status = _cli("status")
            if status.returncode == 0 and "B3" in status.stdout:
                break
            assert time.monotonic() < deadline, status.stderr
            time.sleep(0.2)
        assert "running" in status.stdout and "RUN     " in status.stdout and ": live, started " in status.stdout
        budget = _cli("budget", "B3", "12M")
        assert budget.returncode == 0 and "budget B3: 1M -> 12M" in budget.stdout
        bad = _cli("budget", "B3", "lots")
        assert bad.returncode == 2 and "not a token count" in bad.stderr
        assert "paused B3" in _cli("pause", "B3").stdout
        detail = _cli("detail", "B3")
        assert detail.returncode == 0 and "B3: " in detail.stdout and "latency p50" in detail.stdout
        assert _cli("detail", "nope").returncode == 1
        first = json.loads(_cli("status", "--json").stdout.splitlines()[0])  # the run as a whole leads
        assert first["type"] == "run" and first["phase"] == "live" and first["exit_code"] is None
        assert "killing the run" in _cli("kill").stdout
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "command budget B3" in out and "B3: killed" in out
    assert "no running eagleops engine" in _cli("status").stderr


def test_bad_run_file_exits_2_naming_the_key(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text(
        '[[endpoints]]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n[[datasets]]\nname = "B1"\npath = "x"\ntoken_budget = "ten"\n'
    )
    result = _cli("run", str(run), "--no-tui")
    assert result.returncode == 2
    assert f"{run}: datasets[0].token_budget: not a token count" in result.stderr


def test_generate_against_the_real_tiny_model_server(tmp_path, tiny_model):
    folder = tmp_path / "srv"
    folder.mkdir()
    with start_server(
        ["eagleops.pipeline.demo.model_server", "--model", str(tiny_model), "--name", "tiny"], folder / "port", log_path=folder / "log"
    ) as port:
        source = write_jsonl(
            tmp_path / "a.jsonl", [{"id": f"t{i}", "messages": [{"role": "user", "content": f"explain the cache {i}"}]} for i in range(40)]
        )
        run = _write_run(
            tmp_path, f"http://127.0.0.1:{port}/v1", [("T", source, "600")], concurrency=8, extra=f'tokenizer = "{tiny_model}"'
        )
        result = _cli("run", str(run), "--json")
        assert result.returncode == 0, result.stderr
        events = [json.loads(line) for line in result.stdout.splitlines()]
        final = [e for e in events if e["type"] == "dataset"][-1]
        assert final["state"] == "done" and final["tokens"] >= 600
        records = read_jsonl(tmp_path / "out" / "T" / "data.jsonl")
        assert all(r["usage_source"] == "server" for r in records)
        for r in records:  # random weights: answers are noise, but real tokens of a real model
            assert r["finish_reason"] in ("stop", "length")
            assert 0 <= r["completion_tokens"] <= 64
            assert (r["finish_reason"] == "length") == (r["completion_tokens"] == 64)
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert f"vllm:request_success_total {len(records)}" in metrics


def test_the_readme_demo_runs_offline(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "eagleops", "demo", "--no-tui", "--dir", str(tmp_path / "demo")],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for stage in ("generate", "prepare", "extract", "train", "export", "eval"):
        assert f"STAGE   {stage}: done" in result.stdout, stage
    for name in ("B1", "B2", "B3"):
        manifest = json.loads((tmp_path / "demo" / "out" / name / "manifest.json").read_text())
        assert manifest["totals"]["samples"] > 0
    evaluation = json.loads((tmp_path / "demo" / "out" / "eval.json").read_text())
    assert evaluation["acceptance_length"] > 1.5 and evaluation["greedy_mismatches"] == 0
    again = subprocess.run(
        [sys.executable, "-m", "eagleops", "demo", "--no-tui", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert again.returncode == 0
    assert again.stdout.count("budget reached") >= 3  # at budget: skipped at once
    assert "prepare: up to date" in again.stdout


def test_kill_9_in_the_middle_of_conversations_leaves_no_half_record(tmp_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("multi")
    with start_server(
        ["eagleops.pipeline.testservers.fault", "--tokens", "5", "--latency", "0.1"], folder / "port", log_path=folder / "log"
    ) as port:
        rows = [
            {
                "id": f"c{i}",
                "messages": [
                    m for k in range(3) for m in ({"role": "user", "content": f"q{k} {i}"}, {"role": "assistant", "content": "old"})
                ],
            }
            for i in range(150)
        ]
        source = write_jsonl(tmp_path / "c.jsonl", rows)
        run = _write_run(tmp_path, f"http://127.0.0.1:{port}/v1", [("C", source, "1G")], concurrency=16)
        run.write_text(run.read_text() + 'regenerate = "all"\n')
        kills = _kill_9_repeatedly(run, random.Random(5), times=4, window=(0.8, 1.6))  # mid-conversation
        final = _cli("run", str(run), "--no-tui")
        assert final.returncode == 0, final.stderr + final.stdout
    assert kills >= 2
    records = read_jsonl(tmp_path / "out" / "C" / "data.jsonl")
    assert Counter(r["id"] for r in records) == Counter({f"c{i}": 1 for i in range(150)})
    for record in records:  # whole conversations only, the target's replies throughout
        assert [t["role"] for t in record["conversations"]] == ["user", "assistant"] * 3
        assert all(t["content"] != "old" for t in record["conversations"])


def test_sigterm_is_a_clean_kill_and_a_hangup_leaves_the_run_going(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"s{i}", "prompt": f"x {i} [[tokens:5]] [[delay:0.05]]"} for i in range(2000)])
    run = _write_run(tmp_path, fault_server.base_url, [("S", source, "1G")], concurrency=4)
    for first, then in ((signal.SIGHUP, signal.SIGTERM), (signal.SIGTERM, None)):
        proc = _headless(run)
        try:
            deadline = time.monotonic() + 30
            while _cli("status").returncode != 0:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            before = _samples()
            proc.send_signal(first)
            if then is not None:  # a hangup: the run goes on (it makes more samples after it), still steerable
                deadline = time.monotonic() + 30
                while _samples() <= before:
                    assert proc.poll() is None and time.monotonic() < deadline, "the run stopped at the hangup"
                assert proc.poll() is None and _cli("status").returncode == 0
                proc.send_signal(then)
            assert proc.wait(timeout=30) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    records = read_jsonl(tmp_path / "out" / "S" / "data.jsonl")
    manifest = json.loads((tmp_path / "out" / "S" / "manifest.json").read_text())
    assert records and manifest["totals"]["samples"] == len(records)  # killed cleanly: all saved
