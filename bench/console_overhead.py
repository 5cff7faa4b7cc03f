"""What the console costs: CPU of `eagleops run` with the console (its detached engine plus the
console attached to it) against the same run with --no-tui, the bytes the console writes to its
terminal per second (what an SSH link carries), and key-press -> acknowledged-on-screen latency,
all in a real terminal (tmux, 120x40).

8 datasets, each fed about 10 completions/s by the loopback fault server (80 req/s in all, a
realistic rate for a big generation job's event stream) with 2% of requests failing at random
(retries), the GPU pane fed by the synthetic reader, default 1 s refresh.

    python bench/console_overhead.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagleops.pipeline.servers.launch import start_server


def _run_file(work: Path, base_url: str, name: str) -> Path:
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    text = f'name = "{name}"\noutput_dir = "out"\nconcurrency = 16\n[[endpoints]]\nbase_url = "{base_url}"\nmodel = "m"\n'
    for d in range(8):
        source = folder / f"d{d}.jsonl"
        with open(source, "w") as f:
            for i in range(20000):
                # 2 in flight per dataset x 0.2 s per answer ~ 10 completions/s per dataset
                f.write(json.dumps({"id": f"d{d}-{i}", "prompt": f"item {i} [[tokens:200]] [[delay:0.2]]"}) + "\n")
        text += f'[[datasets]]\nname = "D{d}"\npath = "{source}"\ntoken_budget = "1G"\n'
    run = folder / "run.toml"
    run.write_text(text)
    return run


def _env(work: Path) -> dict:
    env = dict(os.environ, EAGLEOPS_GPU_READER="synthetic", EAGLEOPS_RUNTIME_DIR=str(work / "rt"), PYTHONPATH=str(ROOT))
    return env


def _find_child(marker: str, headless: bool, timeout: float = 30) -> psutil.Process:
    """The eagleops process whose command line names ``marker``: the engine (--no-tui) or the console."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if any(marker in part for part in cmd) and "eagleops" in cmd and ("--no-tui" in cmd) == headless:
                return proc
        time.sleep(0.1)
    raise RuntimeError(f"process with {marker} not found")


def _cpu_times(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def _cpu_over(procs: list[psutil.Process], seconds: float, on_start=lambda: None) -> float:
    """Share of one core used by ``procs`` together over ``seconds``, after a warm-up."""
    time.sleep(5)  # imports, first paint, connections
    on_start()
    before = _cpu_times(procs)
    t0 = time.monotonic()
    time.sleep(seconds)
    return (_cpu_times(procs) - before) / (time.monotonic() - t0)


def measure_headless(work: Path, base_url: str, seconds: float) -> float:
    run = _run_file(work, base_url, "headless")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"],
        env=_env(work),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return _cpu_over([psutil.Process(proc.pid)], seconds)
    finally:
        proc.terminate()
        proc.wait(30)


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def measure_tui(work: Path, base_url: str, seconds: float, presses: int) -> tuple[float, float, float, list[float]]:
    """(CPU of engine + console, of the console alone, bytes/s to the terminal, key latencies)."""
    run = _run_file(work, base_url, "tui")
    session = f"eobench{os.getpid()}"
    env = " ".join(f"{k}={v}" for k, v in _env(work).items() if k in ("EAGLEOPS_GPU_READER", "EAGLEOPS_RUNTIME_DIR", "PYTHONPATH"))
    _tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", f"cd {ROOT} && {env} {sys.executable} -m eagleops run {run}")
    wire = work / "wire.bin"
    try:
        engine, console = _find_child(str(run), headless=True), _find_child(str(run), headless=False)
        window: dict[str, float] = {}

        def start_recording() -> None:
            _tmux("pipe-pane", "-t", session, "-o", f"cat >> {wire}")  # every byte the console writes
            window["t0"] = time.monotonic()

        cpu = _cpu_over([engine, console], seconds, start_recording)
        console_only = _cpu_over([console], seconds / 3)
        _tmux("pipe-pane", "-t", session)
        rate = wire.stat().st_size / (time.monotonic() - window["t0"]) if wire.exists() else 0.0
        latencies = []
        for i in range(presses):  # pause then resume D0, D1, ...: every acknowledgement a new line
            if i and i % 2 == 0:
                _tmux("send-keys", "-t", session, "Down")
                time.sleep(0.3)
            key = "p" if i % 2 == 0 else "r"
            needle = f"command {'pause' if key == 'p' else 'resume'} D{(i // 2) % 8}"
            before = _tmux("capture-pane", "-p", "-t", session).count(needle)
            t0 = time.perf_counter()
            _tmux("send-keys", "-t", session, key)
            while _tmux("capture-pane", "-p", "-t", session).count(needle) <= before:
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"no acknowledgement for {key!r}:\n" + _tmux("capture-pane", "-p", "-t", session))
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.3)
        return cpu, console_only, rate, latencies
    finally:
        _tmux("send-keys", "-t", session, "q")  # detaches; the engine goes on until killed
        time.sleep(1)
        _tmux("kill-session", "-t", session)
        subprocess.run([sys.executable, "-m", "eagleops", "kill"], env=_env(work), capture_output=True)
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--presses", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagleops-console-"))
    try:
        server = ["eagleops.pipeline.testservers.fault", "--tokens", "200", "--fault-rate", "0.02"]
        with start_server(server, work / "port", log_path=work / "server.log") as port:
            base_url = f"http://127.0.0.1:{port}/v1"
            headless = measure_headless(work, base_url, args.seconds)
            tui, console_only, rate, latencies = measure_tui(work, base_url, args.seconds, args.presses)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"## Console overhead ({args.seconds:.0f} s each, 8 datasets at ~10 completions/s each, 2% faults, synthetic GPU, 1 s refresh, 120x40)\n"
    )
    print("| run | CPU (share of one core) |")
    print("|---|---|")
    print(f"| `eagleops run --no-tui` (baseline) | {100 * headless:.1f}% |")
    print(f"| `eagleops run` with the console in tmux: detached engine + attached console | {100 * tui:.1f}% |")
    print(f"| of which the console process | {100 * console_only:.1f}% |")
    print(f"| **console overhead** | **{100 * (tui - headless):.1f}% of one core** |")
    print(f"\nWritten to the terminal by the console: **{rate / 1024:.1f} KB/s** (tmux pipe-pane over {args.seconds:.0f} s)")
    print(f"\nKey-press -> acknowledgement on screen (tmux send-keys to capture-pane showing it, {len(latencies)} presses): "
          f"median {1000 * statistics.median(latencies):.0f} ms, max {1000 * max(latencies):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
