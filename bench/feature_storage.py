"""Feature storage: fp8 (e4m3, a scale per token and layer) against bf16, on the demo. Bytes per
token of the stored features and the acceptance length of a drafter trained on each, with the
same data, seed and schedule (only the features differ).

    python bench/feature_storage.py [--dir DIR] [--seeds 0 1 2]

Runs `eagleops demo` once (generate, then every stage with bf16 features), then for each seed
extract + train + export + eval with bf16 and with fp8 features.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "console.cli", *args], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"eagleops {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _with(run: Path, storage: str, seed: int) -> Path:
    text = run.read_text()
    text = re.sub(r'\nstorage = "\w+"', "", text)
    text = re.sub(r"\nseed = \d+", "", text)
    text = text.replace("[extract]\n", f'[extract]\nstorage = "{storage}"\n').replace("[train]\n", f"[train]\nseed = {seed}\n")
    out = run.with_name(f"run-{storage}-{seed}.toml")
    out.write_text(text)
    return out


def measure(demo: Path, storage: str, seed: int) -> dict:
    run = _with(demo / "run.toml", storage, seed)
    out = demo / "out"
    for stale in ("features", "train", "drafter", "drafter-speculators", "eval.json"):
        path = out / stale
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for stage in ("extract", "train", "export", "eval"):
        _cli(stage, str(run), "--no-tui")
    index = json.loads((out / "features" / "index.json").read_text())
    tokens = sum(s["tokens"] for s in index["shards"].values())
    stored = sum(s["bytes"] for s in index["shards"].values())
    evaluation = json.loads((out / "eval.json").read_text())
    return {"storage": storage, "seed": seed, "bytes_per_token": stored / tokens, "acceptance": evaluation["acceptance_length"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    demo = args.dir or Path(tempfile.mkdtemp(prefix="eagleops-fp8-"))
    _cli("demo", "--no-tui", "--dir", str(demo))
    rows = [measure(demo, storage, seed) for seed in args.seeds for storage in ("bf16", "fp8")]
    print("## Feature storage on the demo (hidden 64, 4 stored vectors per token)\n")
    print("| seed | bf16 bytes/token | fp8 bytes/token | bf16 acceptance | fp8 acceptance |")
    print("|---|---|---|---|---|")
    for seed in args.seeds:
        bf16, fp8 = (next(r for r in rows if r["seed"] == seed and r["storage"] == s) for s in ("bf16", "fp8"))
        print(
            f"| {seed} | {bf16['bytes_per_token']:.1f} | {fp8['bytes_per_token']:.1f} | {bf16['acceptance']:.3f} | {fp8['acceptance']:.3f} |"
        )
    mean = {s: sum(r["acceptance"] for r in rows if r["storage"] == s) / len(args.seeds) for s in ("bf16", "fp8")}
    size = {s: sum(r["bytes_per_token"] for r in rows if r["storage"] == s) / len(args.seeds) for s in ("bf16", "fp8")}
    print(f"\n**fp8 / bf16: {size['fp8'] / size['bf16']:.2f}x the bytes; acceptance {mean['fp8']:.3f} vs {mean['bf16']:.3f} "
          f"({100 * (mean['fp8'] - mean['bf16']) / mean['bf16']:+.1f}%)**")  # fmt: skip


if __name__ == "__main__":
    main()
