"""Why a busy machine slows the ML stages down so much, and what eagleops's thread choice does.

    python bench/cpu_threads.py [--steps 30] [--rounds 3]

One fixed torch workload (a small Llama's forward and backward, as train and extract run it) in
a fresh process, timed from outside (wall clock of the child, CPU seconds from /proc via
psutil), on a quiet machine and beside a busy process that spins on one core (what another job
on a shared 2-core box is). Each contended variant is a ratio against the quiet run of the same
variant, measured in the same round:

* ``torch default``: torch's own thread count (one per core the process may use);
* ``eagleops``: what ``eagleops.pipeline.cpus.torch_threads()`` picks at start (cores we get minus what
  other processes are using now);
* ``passive wait``: torch's default count with ``OMP_WAIT_POLICY=PASSIVE`` (no spinning at
  OpenMP barriers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

WORKLOAD = r"""
import json, os, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "eagleops":
    from eagleops.pipeline.cpus import apply_torch_threads
    apply_torch_threads()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 2048, (4, 256))
started = time.perf_counter()
for _ in range(int(sys.argv[3])):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
print(json.dumps({"seconds": time.perf_counter() - started, "threads": torch.get_num_threads()}))
"""


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _run(variant: str, steps: int) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if variant == "passive wait":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD, str(ROOT), "eagleops" if variant == "eagleops" else "default", str(steps)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    watched = psutil.Process(proc.pid)
    cpu = 0.0
    while proc.poll() is None:
        try:
            times = watched.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            pass
        time.sleep(0.05)
    out = json.loads(proc.stdout.read() if proc.stdout else "{}")
    return {"wall": time.perf_counter() - started, "loop": out["seconds"], "threads": out["threads"], "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = ("torch default", "eagleops", "passive wait")
    results: dict[tuple[str, str], list[dict]] = {}
    print(f"load at start {os.getloadavg()}; {psutil.cpu_count()} cores, affinity {len(os.sched_getaffinity(0))}", flush=True)
    for round_ in range(args.rounds):
        for variant in variants:
            results.setdefault((variant, "quiet"), []).append(_run(variant, args.steps))
            spinner = _spinner()
            try:
                time.sleep(0.5)
                results.setdefault((variant, "busy"), []).append(_run(variant, args.steps))
            finally:
                spinner.kill()
                spinner.wait()
        print(f"round {round_ + 1} done", flush=True)
    print("\n| variant | threads quiet / busy | quiet s | busy s | busy / quiet |\n|---|---|---|---|---|")
    for variant in variants:
        quiet = statistics.median(r["loop"] for r in results[(variant, "quiet")])
        busy = statistics.median(r["loop"] for r in results[(variant, "busy")])
        threads = f"{results[(variant, 'quiet')][0]['threads']} / {results[(variant, 'busy')][0]['threads']}"
        print(f"| {variant} | {threads} | {quiet:.2f} | {busy:.2f} | **{busy / quiet:.2f}x** |")
    print(f"\nload at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
