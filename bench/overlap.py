"""Train following extract, on the demo: when training starts, how long both take, and the most
feature bytes on disk at once. The baseline is extract, then train, measured in the same run.

    python bench/overlap.py [--dir DIR] [--shard-samples 32] [--bound-shards 3] [--repeats 3]

Runs `eagleops demo` once (for its generated and prepared data), then extract + train from no
features, one epoch, the same seed, each `eagleops run` of both stages, three ways:
  sequential   train after extract, a global shuffle (the default; the baseline)
  overlap      [train] overlap_extract = true: train follows extract, shard by shard
  bounded      overlap, and [extract] max_cache_gb = --bound-shards shards' bytes
each --repeats times, in turn; the table has each figure's median.
Times are from each run's `--json` events as they arrive; disk is sampled every 20 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class PeakDisk(threading.Thread):
    def __init__(self, features: Path):
        super().__init__(daemon=True)
        self.features, self.peak, self.done = features, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            total = 0
            try:
                entries = list(os.scandir(self.features))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith("shard-"):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
            self.peak = max(self.peak, total)


def _run_file(demo: Path, mode: str, shard_samples: int, bound_gb: float) -> Path:
    text = (demo / "run.toml").read_text()
    text = re.sub(r"\nshard_samples = \d+", "", text)
    text = re.sub(r"\nepochs = \d+", "", text)
    extract = f"[extract]\nshard_samples = {shard_samples}\n" + (f"max_cache_gb = {bound_gb!r}\n" if mode == "bounded" else "")
    train = f"[train]\nepochs = 1\noverlap_extract = {'false' if mode == 'sequential' else 'true'}\n"
    text = text.replace("[extract]\n", extract).replace("[train]\n", train)
    text = text.replace('output_dir = "out"', 'output_dir = "out"\nstages = ["extract", "train"]')
    path = demo / f"run-{mode}.toml"
    path.write_text(text)
    return path


def _follow(command: list[str], started: float, marks: dict[str, float]) -> None:
    with subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            now = time.monotonic() - started
            if event.get("type") == "stage" and event.get("status") == "running":
                marks.setdefault(f"{event['stage']} start", now)
            if event.get("type") == "stage" and event.get("status") == "done":
                marks[f"{event['stage']} done"] = now
            if event.get("type") == "stage_progress" and event.get("stage") == "train" and event.get("done", 0) >= 1:
                marks.setdefault("first step", now)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}")


def measure(demo: Path, mode: str, shard_samples: int, bound_gb: float) -> dict:
    for stale in ("features", "train"):
        shutil.rmtree(demo / "out" / stale, ignore_errors=True)
    run = str(_run_file(demo, mode, shard_samples, bound_gb))
    cli = [sys.executable, "-m", "eagleops"]
    commands = [[*cli, "run", run, "--json"]]
    watch = PeakDisk(demo / "out" / "features")
    watch.start()
    started = time.monotonic()
    marks: dict[str, float] = {}
    try:
        for command in commands:
            _follow(command, started, marks)
    finally:
        watch.done.set()
        watch.join()
    history = (demo / "out" / "train" / "history.jsonl").read_text().splitlines()
    tail = [json.loads(line)["loss"] for line in history[-20:]]
    return {"mode": mode, **marks, "peak_bytes": watch.peak, "loss": sum(tail) / len(tail), "steps": len(history)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None, help="a demo directory to reuse (made when absent)")
    parser.add_argument("--shard-samples", type=int, default=32)
    parser.add_argument("--bound-shards", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    demo = args.dir or Path(tempfile.mkdtemp(prefix="eagleops-overlap-"))
    if not (demo / "out" / "prepared").exists():
        subprocess.run([sys.executable, "-m", "eagleops", "demo", "--no-tui", "--dir", str(demo)], env=ENV, check=True)
    runs: dict[str, list[dict]] = {"sequential": [], "overlap": [], "bounded": []}
    bound_gb = 0.0
    for _ in range(args.repeats):
        runs["sequential"].append(measure(demo, "sequential", args.shard_samples, 0.0))
        index = json.loads((demo / "out" / "features" / "index.json").read_text())
        bound_gb = args.bound_shards * max(s["bytes"] for s in index["shards"].values()) / 1e9
        for mode in ("overlap", "bounded"):
            runs[mode].append(measure(demo, mode, args.shard_samples, bound_gb))
    rows = [{k: (statistics.median(r[k] for r in found) if k != "mode" else mode) for k in found[0]} for mode, found in runs.items()]
    sequential = rows[0]
    print(f"## extract + train on the demo: {index['samples']} samples in {len(index['shards'])} shards, one epoch\n")
    print("| run | first train step, after extract starts | train done (the run's end) | peak feature bytes on disk | steps | final loss |")
    print("|---|---|---|---|---|---|")
    wait = {row["mode"]: row["first step"] - row["extract start"] for row in rows}
    for row in rows:
        print(
            f"| {row['mode']} | {wait[row['mode']]:.2f} s ({wait[row['mode']] / wait['sequential']:.2f}x) "
            f"| {row['train done']:.1f} s ({row['train done'] / sequential['train done']:.2f}x) "
            f"| {row['peak_bytes'] / 1e6:.2f} MB ({row['peak_bytes'] / sequential['peak_bytes']:.2f}x) | {row['steps']} | {row['loss']:.4f} |"
        )
    print(
        f"\nbound: {bound_gb * 1e3:.3f} MB ({args.bound_shards} x the largest shard); sequential extract took {sequential['extract done'] - sequential['extract start']:.1f} s"
    )


if __name__ == "__main__":
    main()
