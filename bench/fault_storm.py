"""A storm of kill -9s mixed with faults, then one clean run: does anything get lost or doubled?

Each round starts ``eagleops run --no-tui`` headless and kills it with SIGKILL a random moment
later. What the rounds meet, mixed at random:

* a loopback server that fails 10% of requests at random (500, 429, reset, malformed JSON);
* a second endpoint that refuses every connection (failover and benching);
* poisoned rows: a lone surrogate, a torn JSON line, ids shared by several rows, a row whose
  error body echoes the API key, one whose server reports 10^15 tokens;
* a full disk (a small tmpfs filled by a ballast file, freed again at a random moment; root only);
* too few file descriptors (``RLIMIT_NOFILE`` of 40 at a concurrency of 24: EMFILE on sockets and
  on output files alike).

Then the faults go away and a last run finishes. Checked: every source line is in data.jsonl or
failed.jsonl exactly once, every line whole, the manifests' totals equal the files, the key in no
file. Printed: kills, faults met, records lost and duplicated, torn tails repaired.

    python bench/fault_storm.py [--kills 100] [--seed 1]
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.servers.launch import start_server
from pipeline.servers.supervisor import free_port

SECRET = "sk-storm-6f1d2c3b4a5e-do-not-leak"
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
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.key_leaks or self.problems)


def _sources(folder: Path, rows: int) -> dict[str, tuple[Path, int]]:
    """Two sources; A carries the poisoned rows. Returns name -> (path, lines)."""
    a = [json.dumps({"id": f"a{i}", "prompt": f"alpha {i}"}) for i in range(rows)]
    a[7] = '{"id": "torn", "prompt": "half a line'
    a[11] = '{"id": "sur", "prompt": "half an emoji \\ud83d"}'
    a[13] = a[17] = a[19] = json.dumps({"id": "shared", "prompt": "one id, three rows"})
    a[23] = json.dumps({"id": "echo", "prompt": "x [[fault:echo-auth-late]]"})
    a[29] = json.dumps({"id": "huge", "prompt": "x [[usage:completion_tokens=1000000000000000]]"})
    b = [json.dumps({"prompt": f"beta {i}"}) for i in range(rows // 2)]
    out = {}
    for name, lines in (("A", a), ("B", b)):
        path = folder / f"{name.lower()}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out[name] = (path, len(lines))
    return out


def _run_file(folder: Path, out_dir: Path, live: str, dead: str, sources: dict[str, tuple[Path, int]]) -> Path:
    text = (
        f'name = "storm"\noutput_dir = "{out_dir}"\nconcurrency = 24\nflush_interval_s = 0.05\nstatus_interval_s = 0.5\n'
        "[sampling]\nmax_tokens = 64\n[retry]\nbase_delay_s = 0.02\nmax_delay_s = 0.3\nmax_attempts = 30\ntimeout_s = 20\n"
        f'[[endpoints]]\nbase_url = "{live}"\nmodel = "m"\napi_key_env = "{KEY_ENV}"\n'
        f'[[endpoints]]\nbase_url = "{dead}"\nmodel = "m"\napi_key_env = "{KEY_ENV}"\n'
    )
    for name, (path, _) in sources.items():
        text += f'[[datasets]]\nname = "{name}"\npath = "{path}"\ntoken_budget = "1G"\n'
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
            [sys.executable, "-m", "console.cli", "run", str(run), "--no-tui"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_fds,
        )


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _check(out_dir: Path, sources: dict[str, tuple[Path, int]], result: StormResult) -> None:
    for name, (_, lines) in sources.items():
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
    server_argv = ["pipeline.servers.fault", "--tokens", "7", "--latency", "0.25", "--fault-rate", "0.1", "--seed", str(seed)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagleops-storm-") as tmp:
        r = run_storm(Path(tmp), kills=args.kills, seed=args.seed)
    print(
        "\n| kills | rounds | faults met | source lines | lost | duplicated | torn tails repaired | records recovered | storage pauses | key leaks | minutes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r.faults.items()))
    print(
        f"| {r.kills} | {r.rounds} | {faults} | {r.lines} | {r.lost} | {r.duplicated} | {r.repaired_tails} | {r.recovered_records} | {r.storage_pauses} | {r.key_leaks} | {r.seconds / 60:.1f} |"
    )
    for problem in r.problems:
        print(f"PROBLEM: {problem}")
    sys.exit(0 if r.clean else 1)


if __name__ == "__main__":
    main()
