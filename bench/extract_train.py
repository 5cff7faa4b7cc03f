"""Extraction and training cost on CPU with the tiny target, against baselines from the same run.

1. extract tokens/s (the whole stage: length batching, three aux layers + final state, bf16,
   sharded safetensors, index) vs a bare forward pass (``model.model`` without hidden states)
   over the same batches. Goal: extract within 1.3x of the bare forward.
2. bytes on disk per token vs a shard that stores every layer's hidden state for the same samples.
3. train steps/s and tokens/s (reported, no baseline).

    python bench/extract_train.py [--conversations 4000]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS
from eagleops.pipeline.demo.tinymodel import build_tiny_model, sample_text
from eagleops.pipeline.training.artifacts import load_prepared
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.extract.hf import length_batches, pad_batch
from eagleops.pipeline.training.modeling.target import load_target
from eagleops.pipeline.training.prepare.stage import prepare


def _conversations(path: Path, n: int) -> None:
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"role": "user", "content": sample_text(rng, rng.randint(8, 30))},
                {"role": "assistant", "content": sample_text(rng, rng.randint(40, 120))},
            ]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns, "completion_tokens": 0}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=4000)
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "eagleops" / "bench-tiny-llama")
    parser.add_argument("--train-steps", type=int, default=100)
    args = parser.parse_args()
    model_dir = build_tiny_model(args.model_dir, pretrain_steps=TINY_PRETRAIN_STEPS)
    work = Path(tempfile.mkdtemp(prefix="eagleops-extract-"))
    try:
        _conversations(work / "out" / "B" / "data.jsonl", args.conversations)
        config = parse_run(
            {
                "output_dir": str(work / "out"),
                "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
                "datasets": [{"name": "B", "path": str(work / "unused.jsonl"), "token_budget": 1}],
                "target": {"model": str(model_dir)},
                "prepare": {"draft_vocab_size": 256, "eval_fraction": 0.0},
                "extract": {"shard_samples": 256, "batch_tokens": 8192},
                "train": {"max_steps": args.train_steps, "batch_size": 4, "ttt_length": 7, "lr": 3e-3, "checkpoint_every": 10_000},
            },
            base_dir=work,
        )
        prepare(config, StageContext("prepare"))
        index, samples = load_prepared(config.prepared_dir)
        tokens = index.tokens

        from eagleops.pipeline.training.stages import stage_function

        extract = stage_function("extract")
        t0 = time.perf_counter()
        features_index = extract(config, StageContext("extract"))
        extract_s = time.perf_counter() - t0

        model, device, _ = load_target(config.target)
        batches = [
            b
            for first in range(0, len(samples), 256)
            for b in [[first + i for i in batch] for batch in length_batches([len(ids) for ids, _ in samples[first : first + 256]], 8192)]
        ]

        def bare(batch):
            ids, mask = pad_batch([samples[i][0] for i in batch])
            with torch.inference_mode():
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)

        for batch in batches[:3]:
            bare(batch)  # warm-up
        t0 = time.perf_counter()
        for batch in batches:
            bare(batch)
        bare_s = time.perf_counter() - t0

        # every layer, for the same first shard's samples
        first = samples[:256]
        from safetensors.torch import save_file

        everything = []
        with torch.inference_mode():
            for batch in length_batches([len(ids) for ids, _ in first], 8192):
                ids, mask = pad_batch([first[i][0] for i in batch])
                out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                for row, i in enumerate(batch):
                    everything.append(torch.cat([h[row, : len(first[i][0])] for h in out.hidden_states], dim=-1).bfloat16())
        all_path = work / "all-layers.safetensors"
        save_file(
            {
                "hidden": torch.cat(everything),
                "input_ids": torch.cat([ids for ids, _ in first]).int(),
                "loss_mask": torch.cat([m for _, m in first]).to(torch.uint8),
            },
            str(all_path),
        )
        first_tokens = sum(len(ids) for ids, _ in first)
        all_bpt = all_path.stat().st_size / first_tokens
        first_shard = features_index.shards["shard-00000.safetensors"]
        ours_bpt = first_shard.bytes / first_shard.tokens

        summary = stage_function("train")(config, StageContext("train"))
        mean_len = tokens / len(samples)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    layers = model.config.num_hidden_layers
    print(
        f"## Extract and train (tiny target: {layers} layers, hidden {model.config.hidden_size}; {len(samples)} samples, {tokens:,} tokens; CPU, {torch.get_num_threads()} threads)\n"
    )
    print("| measure | eagleops | baseline | ratio |")
    print("|---|---|---|---|")
    print(
        f"| extract tokens/s (whole stage incl. writes) vs bare forward | {tokens / extract_s:,.0f} | {tokens / bare_s:,.0f} (bare `model.model` forward, same batches) | **{extract_s / bare_s:.2f}x** the time |"
    )
    m = features_index.metrics or {}
    print(
        f"| extract, forward + copies only (excl. model load and writes) | {m['forward_tokens_per_s']:,.0f} | {tokens / bare_s:,.0f} | **{tokens / m['forward_tokens_per_s'] / bare_s:.2f}x** the time |"
    )
    print(
        f"| bytes on disk per token | {ours_bpt:,.0f} B (3 aux + final, bf16) | {all_bpt:,.0f} B (all {layers + 1} hidden states, bf16) | **{ours_bpt / all_bpt:.2f}x** |"
    )
    print(f"| train (TTT 7, batch 4) | {summary.steps_per_s:.1f} steps/s, {summary.steps_per_s * 4 * mean_len:,.0f} tokens/s | - | - |")
    print(
        f"\nAt H=4096 the same layout is (4 x 4096 x 2 + 5) = {4 * 4096 * 2 + 5:,} B/token; a 32-layer target's all-layer dump would be {33 * 4096 * 2 + 5:,} B/token."
    )


if __name__ == "__main__":
    main()
