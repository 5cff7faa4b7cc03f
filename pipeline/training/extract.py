"""extract: run the target over every prepared sample and keep what EAGLE-3 trains on.

Per token: ``input_ids``, ``loss_mask``, the three auxiliary hidden states (3H) and the final
hidden state (H, what the target's lm_head reads: training recomputes the target's distribution
from it instead of storing vocab-sized logits), in bf16. That is (4H x 2 + 5) bytes a token
instead of (N + 1) x H x 2 for every layer.

Shards of ``shard_samples`` consecutive prepared samples, each written to a temporary name and
renamed, then recorded in ``index.json`` (atomically): a killed extract resumes at the first
missing shard, and a shard is a pure function of its samples, so it comes out byte-identical.
Inside a shard samples are batched by length (longest first, up to ``batch_tokens`` padded
tokens a batch) and written back in order.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, TargetConfig
from pipeline.training.drafter import eagle3_aux_layers
from pipeline.training.prepare import load_prepared
from pipeline.training.context import StageContext
from pipeline.files import write_json_atomic

__all__ = ["FeatureShards", "extract", "forward_features", "length_batches", "load_target", "pad_batch", "pick_device"]


def pick_device(target: TargetConfig):
    import torch

    if target.device != "auto":
        device = torch.device(target.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if target.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    else:
        dtype = getattr(torch, target.dtype)
    return device, dtype


def load_target(target: TargetConfig):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device, dtype = pick_device(target)
    model = AutoModelForCausalLM.from_pretrained(str(target.model), dtype=dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return model, device, dtype


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest-first so that each batch pads to at most ``batch_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_batch(rows):
    """(input_ids, attention_mask) [B, W] of 1-D id tensors right-padded to the longest."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r.long()
        mask[i, : len(r)] = 1
    return ids, mask


def forward_features(model, input_ids_list, aux_layers, device, dtype=None):
    """(aux [B, W, 3H], final [B, W, H]) for 1-D id tensors right-padded together to width W."""
    import torch

    ids, mask = pad_batch(input_ids_list)
    with torch.inference_mode():
        out = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states  # [embeddings, layer 0 out, ..., layer N-1 out (post-norm)]
        aux = torch.cat([hidden[layer + 1] for layer in aux_layers], dim=-1)
        final = out.last_hidden_state
        if dtype is not None:
            aux, final = aux.to(dtype), final.to(dtype)
    return aux, final


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _write_shard(out: Path, name: str, chunk, offsets, aux, final, first: int, aux_layers, index: dict, index_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {
        "input_ids": torch.cat([ids for ids, _ in chunk]).to(torch.int32),
        "loss_mask": torch.cat([mask for _, mask in chunk]).to(torch.uint8),
        "aux": aux,
        "final": final,
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    tmp = out / (name + ".tmp")
    # one metadata key: safetensors writes its metadata map in hash order, and a shard must come
    # out byte-identical when a killed extract redoes it
    save_file(tensors, str(tmp), metadata={"eagleops": json.dumps({"first_sample": first, "aux_layers": list(aux_layers)}, sort_keys=True)})
    os.replace(tmp, out / name)
    index["shards"][name] = {"first_sample": first, "samples": len(chunk), "tokens": offsets[-1], "bytes": (out / name).stat().st_size}
    write_json_atomic(index_path, index)


def extract(config: RunConfig, ctx: StageContext) -> dict[str, Any]:
    import torch

    assert config.target is not None
    prepared_index, samples = load_prepared(config.prepared_dir)
    out = config.features_dir
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / "index.json"
    index: dict[str, Any] = json.loads(index_path.read_text()) if index_path.exists() else {}
    if index.get("prepared") != prepared_index["fingerprint"]:
        index = {}
    model, device, dtype = load_target(config.target)
    layers = model.config.num_hidden_layers
    aux_layers = tuple(config.extract.aux_layers) if config.extract.aux_layers else eagle3_aux_layers(layers)
    if max(aux_layers) >= layers:
        raise ValueError(f"extract.aux_layers {list(aux_layers)}: the target has only {layers} layers")
    if index and tuple(index.get("aux_layers", ())) != aux_layers:
        index = {}
    if not index:
        index = {"prepared": prepared_index["fingerprint"], "aux_layers": list(aux_layers), "hidden_size": model.config.hidden_size,
                 "num_layers": layers, "target": str(config.target.model), "shards": {}}  # fmt: skip
    per = config.extract.shard_samples
    hidden_size = model.config.hidden_size
    total_tokens = prepared_index["tokens"]
    done_tokens = sum(s["tokens"] for s in index["shards"].values())
    started, fresh_tokens, compute_s = time.monotonic(), 0, 0.0
    # Shards are written by one background thread while the next one computes; at most one write
    # is in flight, and a shard enters the index only once renamed into place.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
    pending = None
    try:
        for first in range(0, len(samples), per):
            name = _shard_name(first // per)
            if name in index["shards"] and (out / name).exists():
                continue
            ctx.checkpoint()
            chunk = samples[first : first + per]
            offsets = [0]
            for ids, _ in chunk:
                offsets.append(offsets[-1] + len(ids))
            # the shard's tensors, filled in place batch by batch (no per-sample copies, no concat)
            aux_out = torch.empty((offsets[-1], 3 * hidden_size), dtype=torch.bfloat16)
            final_out = torch.empty((offsets[-1], hidden_size), dtype=torch.bfloat16)
            for batch in length_batches([len(ids) for ids, _ in chunk], config.extract.batch_tokens):
                ctx.checkpoint()
                t0 = time.perf_counter()
                aux, final = forward_features(model, [chunk[i][0] for i in batch], aux_layers, device, torch.bfloat16)
                aux, final = aux.cpu(), final.cpu()
                for row, i in enumerate(batch):
                    n = offsets[i + 1] - offsets[i]
                    aux_out[offsets[i] : offsets[i + 1]] = aux[row, :n]
                    final_out[offsets[i] : offsets[i + 1]] = final[row, :n]
                compute_s += time.perf_counter() - t0
                fresh_tokens += sum(len(chunk[i][0]) for i in batch)
                ctx.progress(done_tokens + fresh_tokens, total_tokens, "tokens")
            if pending is not None:
                pending.result()
            pending = writer.submit(_write_shard, out, name, chunk, offsets, aux_out, final_out, first, aux_layers, index, index_path)
        if pending is not None:
            pending.result()
    finally:
        writer.shutdown(wait=True)
    stored = sum(s["bytes"] for s in index["shards"].values())
    tokens = sum(s["tokens"] for s in index["shards"].values())
    hidden = model.config.hidden_size
    elapsed = time.monotonic() - started
    metrics = {
        "tokens": tokens,
        "tokens_per_s": round(fresh_tokens / elapsed, 1) if fresh_tokens and elapsed > 0 else None,
        "forward_tokens_per_s": round(fresh_tokens / compute_s, 1) if compute_s > 0 else None,
        "bytes_per_token": round(stored / tokens, 1) if tokens else None,
        "all_layers_bytes_per_token": (layers + 1) * hidden * 2 + 5,
    }
    if device.type == "cuda":
        metrics["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    index["metrics"] = metrics
    write_json_atomic(index_path, index)
    ctx.metrics(**metrics)
    ctx.progress(tokens, total_tokens, "tokens", force=True)
    ctx.log("info", f"extract: {tokens} tokens in {len(index['shards'])} shards, {metrics['bytes_per_token']} B/token (all layers would be {metrics['all_layers_bytes_per_token']})")
    return index


class FeatureShards:
    """Random access to extracted samples without loading every shard first: a shard is opened
    (memory-mapped by safetensors) when one of its samples is asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index = json.loads((directory / "index.json").read_text())
        self.entries: list[tuple[str, int]] = []  # (shard file, position in shard) per sample
        for name in sorted(self.index["shards"], key=lambda n: self.index["shards"][n]["first_sample"]):
            self.entries += [(name, j) for j in range(self.index["shards"][name]["samples"])]
        self._open: dict[str, Any] = {}
        self._offsets: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.index["aux_layers"])

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            if len(self._open) > 8:
                self._open.pop(next(iter(self._open)))
            handle = safe_open(str(self.directory / name), framework="pt")
            self._open[name] = handle
            self._offsets[name] = handle.get_tensor("offsets").tolist()
        return self._open[name]

    def length(self, i: int) -> int:
        name, j = self.entries[i]
        self._handle(name)
        offsets = self._offsets[name]
        return offsets[j + 1] - offsets[j]

    def __getitem__(self, i: int) -> dict[str, Any]:
        name, j = self.entries[i]
        handle = self._handle(name)
        a, b = self._offsets[name][j], self._offsets[name][j + 1]
        return {key: handle.get_slice(key)[a:b] for key in ("input_ids", "loss_mask", "aux", "final")}
