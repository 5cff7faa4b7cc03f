"""A storm of kill -9s mixed with faults, then one clean run: does anything get lost or doubled?

Each round starts ``eagleops run --no-tui`` headless and kills it with SIGKILL a random moment
later. What the rounds meet, mixed at random:

* a loopback server that fails 10% of requests at random (500, 429, reset, malformed JSON);
* a second endpoint that refuses every connection (failover and benching);
* poisoned rows: a lone surrogate, a torn JSON line, ids shared by several rows, a row whose
  error body echoes the API key, one whose server reports 10^15 tokens;
* a full disk (a small tmpfs filled by a ballast file, freed again at a random moment; root only);
* too few file descriptors (``RLIMIT_NOFILE`` of 40 at a concurrency of 24: EMFILE on sockets and
  on output files alike);
* odd replies: ``usage`` as a string, a lone surrogate in the content (retried, then recorded);
* a third source regenerated whole (``regenerate = "all"``, 4-turn conversations, one ending in a
  tool call) under a budget: its overshoot must stay within in-flight x max_tokens;
* a hangup (SIGHUP) at a random moment of a round's first second: the run must go on.

Then the faults go away and a last run finishes. Checked: every source line is in data.jsonl or
failed.jsonl exactly once, every line whole, the manifests' totals equal the files, the key in no
file. Printed: kills, faults met, records lost and duplicated, torn tails repaired.

``--servers N`` storms the servers eagleops supervises instead: N rounds, each a headless run
that serves its target with a fake vLLM (``bench/fake_vllm.py``: vLLM's command line, a child
in its process group) and is killed with SIGKILL. Each round, at random: killed once its server
serves; killed while it starts (maybe between the spawn and the server's first line); killed
together with the tether that leads its server's group, so that only the next run's start can
stop what is left. Counted: server processes left behind (after 30 s; for the tether rounds,
once the next run serves), leftovers a resume stopped, the slowest clean-up. Must be 0 left.

    python bench/fault_storm.py [--kills 100] [--seed 1]
    python bench/fault_storm.py --servers 24 [--seed 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagleops.pipeline.servers.launch import start_server
from eagleops.pipeline.servers.supervisor import free_port

SECRET = "sk-storm-6f1d2c3b4a5e-do-not-leak"
BUDGET_C, CONCURRENCY, MAX_TOKENS = 4000, 24, 64
KEY_ENV = "EAGLEOPS_STORM_KEY"


@dataclass
class StormResult:
    kills: int = 0
    rounds: int = 0
    faults: Counter = field(default_factory=Counter)
    lines: int = 0
    lost: int = 0
    duplicated: int = 0
    repaired_tails: int = 0
    recovered_records: int = 0
    storage_pauses: int = 0
    key_leaks: int = 0
    hangups: int = 0
    hangups_fatal: int = 0
    budgeted_tokens: int = 0  # written by the regenerated source, against BUDGET_C + in flight x max_tokens
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.key_leaks or self.hangups_fatal or self.problems)


def _sources(folder: Path, rows: int) -> dict[str, tuple[Path, int]]:
    """Two sources; A carries the poisoned rows. Returns name -> (path, lines)."""
    a = [json.dumps({"id": f"a{i}", "prompt": f"alpha {i}"}) for i in range(rows)]
    a[7] = '{"id": "torn", "prompt": "half a line'
    a[11] = '{"id": "sur", "prompt": "half an emoji \\ud83d"}'
    a[13] = a[17] = a[19] = json.dumps({"id": "shared", "prompt": "one id, three rows"})
    a[23] = json.dumps({"id": "echo", "prompt": "x [[fault:echo-auth-late]]"})
    a[29] = json.dumps({"id": "huge", "prompt": "x [[usage:completion_tokens=1000000000000000]]"})
    a[31] = json.dumps({"id": "oddusage", "prompt": "x [[fault:oddusagex1]]"})
    a[37] = json.dumps({"id": "surrogate", "prompt": "x [[fault:surrogatex1]]"})
    b = [json.dumps({"prompt": f"beta {i}"}) for i in range(rows // 2)]
    c = [
        json.dumps(
            {
                "id": f"c{i}",
                "messages": [
                    m for k in range(4) for m in ({"role": "user", "content": f"c{i} turn {k}"}, {"role": "assistant", "content": "old"})
                ],
            }
        )
        for i in range(rows // 4)
    ]
    c[3] = json.dumps(
        {
            "id": "calls",
            "messages": [
                {"role": "user", "content": "add"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
                },
            ],
        }
    )
    out = {}
    for name, lines in (("A", a), ("B", b), ("C", c)):
        path = folder / f"{name.lower()}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out[name] = (path, len(lines))
    return out


def _run_file(folder: Path, out_dir: Path, live: str, dead: str, sources: dict[str, tuple[Path, int]]) -> Path:
    text = (
        f'name = "storm"\noutput_dir = "{out_dir}"\nconcurrency = {CONCURRENCY}\nflush_interval_s = 0.05\nstatus_interval_s = 0.5\n'
        f"[sampling]\nmax_tokens = {MAX_TOKENS}\n[retry]\nbase_delay_s = 0.02\nmax_delay_s = 0.3\nmax_attempts = 30\ntimeout_s = 20\n"
        f'[[endpoints]]\nbase_url = "{live}"\nmodel = "m"\napi_key_env = "{KEY_ENV}"\n'
        f'[[endpoints]]\nbase_url = "{dead}"\nmodel = "m"\napi_key_env = "{KEY_ENV}"\n'
    )
    for name, (path, _) in sources.items():
        budget = f'{BUDGET_C}\nregenerate = "all"' if name == "C" else '"1G"'
        text += f'[[datasets]]\nname = "{name}"\npath = "{path}"\ntoken_budget = {budget}\n'
    run = folder / "run.toml"
    run.write_text(text)
    return run


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[bool]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    ballast = disk / "ballast"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(ballast, "ab") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(0, free - leave))
    return ballast


def _start(run: Path, log: Path, few_fds: bool) -> subprocess.Popen:
    def limit_fds() -> None:
        os.setpgrp()
        if few_fds:
            resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    env = {**os.environ, "PYTHONPATH": str(ROOT), KEY_ENV: SECRET}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_fds,
        )


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _check_budgeted(out_dir: Path, result: StormResult) -> None:
    """The regenerated source: no conversation twice, each record ends in the target's reply, and
    the budget overshot by no more than what can be in flight."""
    records = [json.loads(line) for line in (out_dir / "C" / "data.jsonl").read_bytes().splitlines()]
    result.budgeted_tokens = sum(r["completion_tokens"] for r in records)
    if result.budgeted_tokens > BUDGET_C + CONCURRENCY * MAX_TOKENS:
        result.problems.append(f"C: {result.budgeted_tokens} tokens written for a budget of {BUDGET_C}")
    if len({r["id"] for r in records}) != len(records):
        result.problems.append("C: a conversation recorded twice")
    if any(r["conversations"][-1]["role"] != "assistant" for r in records):
        result.problems.append("C: a record that does not end in the target's reply")


def _check(out_dir: Path, sources: dict[str, tuple[Path, int]], result: StormResult) -> None:
    _check_budgeted(out_dir, result)
    for name, (_, lines) in sources.items():
        if name == "C":  # under a budget: most of its lines are never read
            continue
        seen: Counter = Counter()
        for file in ("data.jsonl", "failed.jsonl"):
            raw = (out_dir / name / file).read_bytes()
            if raw and not raw.endswith(b"\n"):
                result.problems.append(f"{name}/{file}: ends in a partial line")
            records = [json.loads(line) for line in raw.splitlines()]
            seen.update(r["source_line"] for r in records)
            if file == "data.jsonl":
                manifest = json.loads((out_dir / name / "manifest.json").read_text())
                if manifest["totals"]["samples"] != len(records) or manifest["totals"]["tokens"] != sum(
                    r["completion_tokens"] for r in records
                ):
                    result.problems.append(f"{name}: manifest totals differ from data.jsonl")
        result.lines += lines
        result.lost += sum(1 for line in range(1, lines + 1) if line not in seen)
        result.duplicated += sum(n - 1 for n in seen.values() if n > 1)
    for path in out_dir.rglob("*"):
        if path.is_file() and SECRET[:12] in path.read_text(errors="replace"):
            result.key_leaks += 1


def run_storm(workdir: Path, *, kills: int, seed: int = 1, rows_per_kill: int = 120, say: Callable[[str], None] = print) -> StormResult:
    """``kills`` rounds that end in SIGKILL (a round the run survives to its end is not counted)."""
    rng = random.Random(seed)
    result = StormResult()
    started = time.monotonic()
    sources = _sources(workdir, max(200, kills * rows_per_kill))
    log = workdir / "runs.log"
    server_argv = ["eagleops.pipeline.testservers.fault", "--tokens", "7", "--latency", "0.25", "--fault-rate", "0.1", "--seed", str(seed)]
    with start_server(server_argv, workdir / "port", log_path=workdir / "server.log") as port, _tmpfs(workdir / "disk", "16m") as on_tmpfs:
        out_dir = (workdir / "disk" if on_tmpfs else workdir) / "out"
        run = _run_file(workdir, out_dir, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{free_port()}/v1", sources)
        while result.kills < kills and result.rounds < kills * 3:
            result.rounds += 1
            modes = [m for m in ("disk-full", "few-fds") if rng.random() < 0.25 and (m != "disk-full" or on_tmpfs)]
            result.faults.update(modes or ["faults only"])
            ballast = _fill(workdir / "disk", leave=30_000) if "disk-full" in modes else None
            proc = _start(run, log, "few-fds" in modes)
            if ballast is not None:  # space comes back at a random moment, maybe only after the kill
                threading.Timer(rng.uniform(0.5, 3.0), lambda b=ballast: b.unlink(missing_ok=True)).start()
            if rng.random() < 0.3:  # a terminal that goes in the run's first second
                time.sleep(rng.uniform(0.1, 1.0))
                result.hangups += 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGHUP)
                time.sleep(0.3)
                if proc.poll() is not None and proc.returncode < 0:
                    result.hangups_fatal += 1
            time.sleep(rng.uniform(0.7, 2.2))
            if proc.poll() is None:
                _kill_group(proc)
                result.kills += 1
            if ballast is not None:
                time.sleep(0.01)
                ballast.unlink(missing_ok=True)
            if result.rounds % 10 == 0:
                say(f"  round {result.rounds}: {result.kills} kills")
        final = _start(run, log, few_fds=False)
        if final.wait(timeout=900) != 0:
            result.problems.append(f"the last run exited {final.returncode}")
        _check(out_dir, sources, result)  # before the tmpfs goes
    text = log.read_text(errors="replace")
    result.repaired_tails = text.count("truncated a torn")
    result.recovered_records = sum(
        int(part.split(" records written")[0].rsplit(" ", 1)[-1]) for part in text.split("recovered ")[1:] if " records written" in part
    )
    result.storage_pauses = text.count("cannot save:")
    if "Traceback" in text:
        result.problems.append("a traceback in a run's output: " + text[text.index("Traceback") :][:1500])
    result.seconds = time.monotonic() - started
    return result


# ---- the servers' storm: eagleops killed while it supervises a (fake) vLLM ---------------------------

FAKE_VLLM = ROOT / "bench" / "fake_vllm.py"
MARK_ENV = "FAKE_VLLM_PIDS"  # the fake's own variable; in every process of every storm server's group
CLEANUP_S = 30.0  # the tether gives a server 15 s to stop, then SIGKILLs; 30 s is far past that


@dataclass
class ServerStormResult:
    rounds: int = 0
    kills: int = 0
    modes: Counter = field(default_factory=Counter)
    left_behind: int = 0
    stopped_by_resume: int = 0  # runs whose start found what a run killed with its tether left, and stopped it
    slowest_cleanup_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.left_behind or self.problems)


def _marked(mark: Path) -> list[psutil.Process]:
    """Live processes (not zombies) of this storm's servers, found by the variable they carry."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARK_ENV) == str(mark) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:  # is_running checks the start time
                alive.append(proc)
    return alive


def _server_run_file(workdir: Path, mark: Path) -> Path:
    """A run that serves its target with the fake vLLM, slowly enough never to finish in a round."""
    python = workdir / "fake-python"  # named as serve.python; vLLM's `-m module` is skipped by the fake
    python.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    python.chmod(0o755)
    source = workdir / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(20_000)))
    run = workdir / "servers.toml"
    run.write_text(
        f'name = "server-storm"\noutput_dir = "{workdir / "out"}"\nconcurrency = 4\nflush_interval_s = 0.1\n'
        "[sampling]\nmax_tokens = 16\n"
        f'[serve]\npython = "{python}"\nmodel = "{workdir}"\nstartup_timeout_s = 60\nmax_restarts = 2\n'
        f'extra_args = ["--latency", "0.2"]\nenv = {{ {MARK_ENV} = "{mark}" }}\n'
        f'[[datasets]]\nname = "A"\npath = "{source}"\ntoken_budget = "1G"\n'
    )
    return run


def _wait(condition: Callable[[], object], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _tether_record(out_dir: Path, engine_pid: int) -> dict | None:
    """The record of the server group ``engine_pid`` started, once it has written it: the server
    may be up a moment before its engine records it (an older run's record is not this one)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((out_dir / "servers" / "vllm-generate.pid.json").read_text())
        if isinstance(record, dict) and record.get("owner", {}).get("pid") == engine_pid:
            return record
    return None


def _kill_tether(out_dir: Path, engine_pid: int) -> bool:
    """SIGKILL the tether leading the server's group, as its record names it (pid and start time)."""
    try:
        record = _tether_record(out_dir, engine_pid)
        if record is None:
            return False
        tether = psutil.Process(record["pid"])
        if abs(tether.create_time() - record["started"]) < 0.01:
            tether.kill()
            return True
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    return False


def _server_round(
    run: Path, log: Path, mark: Path, mode: str, rng: random.Random, pending: list[psutil.Process], result: ServerStormResult
) -> tuple[list[psutil.Process], bool]:
    """One run killed as ``mode`` says: what it leaves for a later run's start to stop, and whether
    its own server started (after that start has stopped what earlier runs left)."""
    servers_before = len(list(mark.glob("*.json")))

    def spawned() -> bool:
        return len(list(mark.glob("*.json"))) > servers_before

    engine = _start(run, log, few_fds=False)
    tether_killed = False
    try:
        if mode == "starting":
            time.sleep(rng.uniform(0.3, 2.5))
        elif not _wait(lambda: spawned() or engine.poll() is not None, 90):
            result.problems.append(f"round {result.rounds}: the server never started")
        else:
            time.sleep(rng.uniform(0.2, 1.5))
            if mode == "with tether" and not _wait(lambda: _tether_record(run.parent / "out", engine.pid), 10):
                result.problems.append(f"round {result.rounds}: the server's group was never recorded")
        if engine.poll() is not None:
            result.problems.append(f"round {result.rounds}: eagleops exited by itself ({engine.returncode})")
        else:
            os.kill(engine.pid, signal.SIGKILL)  # eagleops alone, as `kill -9 PID` does
            tether_killed = mode == "with tether" and _kill_tether(run.parent / "out", engine.pid)
            if mode == "with tether" and not tether_killed:
                result.problems.append(f"round {result.rounds}: the tether was not found to kill")
            result.kills += 1
            engine.wait()
    finally:
        if engine.poll() is None:  # only while unreaped is its pid still its own
            _kill_group(engine)
    killed_at = time.monotonic()
    if tether_killed:
        return [p for p in _marked(mark) if p not in pending], spawned()

    def ours() -> list[psutil.Process]:
        return [p for p in _marked(mark) if p not in pending]  # the earlier runs' are counted apart

    if not _wait(lambda: not ours(), CLEANUP_S):
        left = ours()
        result.left_behind += len(left)
        result.problems.append(f"round {result.rounds}: left running {CLEANUP_S:.0f} s after the kill: {[p.pid for p in left]}")
        for proc in left:  # each round starts from nothing, so one failure is counted once
            with contextlib.suppress(psutil.Error):
                proc.kill()
    result.slowest_cleanup_s = max(result.slowest_cleanup_s, time.monotonic() - killed_at)
    return [], spawned()


def run_server_storm(
    workdir: Path, *, rounds: int, seed: int = 1, modes: Sequence[str] = (), say: Callable[[str], None] = print
) -> ServerStormResult:
    """``rounds`` runs of eagleops killed with SIGKILL while they supervise a fake vLLM, each killed
    as ``modes`` says or else at random; the last one is killed while serving, so nothing of any
    round may be running at the end."""
    rng = random.Random(seed)
    result = ServerStormResult()
    started = time.monotonic()
    mark = workdir / "pids"
    mark.mkdir(parents=True, exist_ok=True)
    run, log = _server_run_file(workdir, mark), workdir / "server-runs.log"
    pending: list[psutil.Process] = []  # left by runs killed with their tether, until a run's server starts
    try:
        while result.rounds < rounds:
            result.rounds += 1
            if result.rounds <= len(modes):
                mode = modes[result.rounds - 1]
            elif result.rounds == rounds:
                mode = "serving"
            else:
                mode = rng.choices(["serving", "starting", "with tether"], [0.5, 0.2, 0.3])[0]
            result.modes[mode] += 1
            left, spawned = _server_round(run, log, mark, mode, rng, pending, result)
            if spawned and pending:  # that start had to stop them first
                if still := _running(pending):
                    result.left_behind += len(still)
                    result.problems.append(f"round {result.rounds}: the resume left an earlier server's {[p.pid for p in still]} running")
                    for proc in still:
                        with contextlib.suppress(psutil.Error):
                            proc.kill()
                else:
                    result.stopped_by_resume += 1
            pending = [*(_running(pending) if not spawned else []), *left]
            if result.rounds % 5 == 0:
                say(f"  round {result.rounds}: {result.kills} kills, {result.left_behind} left behind")
        if _marked(mark):
            result.problems.append(f"after the storm: {len(_marked(mark))} server processes running")
    finally:
        for proc in _marked(mark):  # whatever happened, the storm leaves nothing running
            with contextlib.suppress(psutil.Error):
                proc.kill()
    result.seconds = time.monotonic() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--servers", type=int, default=0, metavar="ROUNDS", help="storm the supervised servers instead")
    args = parser.parse_args()
    if args.servers:
        with tempfile.TemporaryDirectory(prefix="eagleops-server-storm-") as tmp:
            _print_servers(run_server_storm(Path(tmp), rounds=args.servers, seed=args.seed))
        return
    with tempfile.TemporaryDirectory(prefix="eagleops-storm-") as tmp:
        r = run_storm(Path(tmp), kills=args.kills, seed=args.seed)
    print(
        "\n| kills | rounds | faults met | source lines | lost | duplicated | torn tails repaired | records recovered | storage pauses | key leaks | hangups (fatal) | regenerated tokens / bound | minutes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r.faults.items()))
    bound = BUDGET_C + CONCURRENCY * MAX_TOKENS
    print(
        f"| {r.kills} | {r.rounds} | {faults} | {r.lines} | {r.lost} | {r.duplicated} | {r.repaired_tails} | {r.recovered_records} | {r.storage_pauses} | {r.key_leaks} | {r.hangups} ({r.hangups_fatal}) | {r.budgeted_tokens:,} / {bound:,} | {r.seconds / 60:.1f} |"
    )
    for problem in r.problems:
        print(f"PROBLEM: {problem}")
    sys.exit(0 if r.clean else 1)


def _print_servers(r: ServerStormResult) -> None:
    print(
        "\n| rounds | kills (serving / starting / with tether) | server processes left behind | resumes seen stopping a leftover | slowest clean-up | minutes |"
    )
    print("|---|---|---|---|---|---|")
    modes = " / ".join(str(r.modes[m]) for m in ("serving", "starting", "with tether"))
    print(
        f"| {r.rounds} | {r.kills} ({modes}) | {r.left_behind} | {r.stopped_by_resume} | {r.slowest_cleanup_s:.1f} s | {r.seconds / 60:.1f} |"
    )
    for problem in r.problems:
        print(f"PROBLEM: {problem}")
    sys.exit(0 if r.clean else 1)


if __name__ == "__main__":
    main()
