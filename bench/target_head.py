"""The target head at a Kimi-K2.5-sized vocabulary: peak memory and time of one training step's
target computation (top-1 over the whole vocabulary + draft-vocabulary probabilities), the whole
head at once (the baseline: [tokens, V] logits) against chunks of ``train.head_chunk`` rows.

Each mode runs in a fresh process; peak memory is the process's peak RSS above what it held once
the inputs were allocated (CPU; on CUDA it would be ``torch.cuda.max_memory_allocated``).

    python bench/target_head.py [--vocab 163840] [--hidden 7168] [--tokens 512] [--draft 32000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _one(args: argparse.Namespace, chunk: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import psutil
    import torch

    from eagleops.pipeline.training.train.loss import target_top_and_draft_probs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    head = torch.randn(args.vocab, args.hidden)
    final = torch.randn(1, args.tokens, args.hidden)
    draft_head = head[torch.randperm(args.vocab)[: args.draft]].contiguous()
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    with torch.no_grad():
        top, _ = target_top_and_draft_probs(final, head, draft_head, chunk)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"chunk": chunk, "extra_mib": (peak - before) / 2**20, "seconds": seconds, "top_sum": int(top.sum())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=163_840)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--draft", type=int, default=32_000)
    parser.add_argument("--chunk", type=int, default=32_768)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args, args.one)))
        return
    rows = []
    for chunk in (0, args.chunk):
        command = [
            sys.executable,
            __file__,
            "--one",
            str(chunk),
            *(f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "tokens", "draft")),
        ]
        rows.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
    whole, chunked = rows
    assert whole["top_sum"] == chunked["top_sum"], "the chunked top-1 differs"
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"## Target head: vocab {args.vocab:,}, hidden {args.hidden}, {args.tokens} tokens, draft vocab {args.draft:,} (fp32, CPU)\n")
    print("| mode | peak memory above inputs | time |")
    print("|---|---|---|")
    print(f"| whole head (baseline; [T, V] logits = {logits_mib:.0f} MiB) | {whole['extra_mib']:.0f} MiB | {whole['seconds']:.2f} s |")
    print(f"| chunks of {args.chunk:,} rows | {chunked['extra_mib']:.0f} MiB | {chunked['seconds']:.2f} s |")
    print(f"| **chunked / whole** | **{chunked['extra_mib'] / whole['extra_mib']:.2f}x** | {chunked['seconds'] / whole['seconds']:.2f}x |")
    print("\nSame top-1 for every token in both modes (checked).")


if __name__ == "__main__":
    main()
