"""Extracted features, read lazily: a shard is memory-mapped (safetensors) when one of its
samples is first asked for, so training's step 1 does not wait for every file to be read."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import ConfigError
from pipeline.training.artifacts import FeatureShard, FeaturesIndex, PreparedIndex
from pipeline.training.drafter import eagle3_aux_layers
from pipeline.training.target import require_target

__all__ = [
    "ExtractRates",
    "FeatureShards",
    "extract_metrics",
    "from_fp8",
    "to_fp8",
    "open_features_index",
    "shard_name",
    "shards_to_do",
    "write_feature_shard",
]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def shards_to_do(index: FeaturesIndex, out: Path, samples: int, per_shard: int) -> list[tuple[int, str]]:
    """(first sample, shard file) of every shard not yet written: where a resumed extract starts."""
    todo = [(first, shard_name(first // per_shard)) for first in range(0, samples, per_shard)]
    return [(first, name) for first, name in todo if not (name in index.shards and (out / name).exists())]


def write_feature_shard(
    out: Path, name: str, chunk: list[Any], offsets: list[int], aux: Any, final: Any, first: int, index: FeaturesIndex
) -> None:
    import json
    import os

    import torch
    from safetensors.torch import save_file

    tensors = {
        "input_ids": torch.cat([ids for ids, _ in chunk]).to(torch.int32),
        "loss_mask": torch.cat([mask for _, mask in chunk]).to(torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if index.storage == "fp8":
        layers = len(index.aux_layers)
        tensors["aux"], tensors["aux_scale"] = to_fp8(aux.reshape(aux.shape[0], layers, -1))
        tensors["final"], tensors["final_scale"] = to_fp8(final.unsqueeze(1))
    else:
        tensors["aux"], tensors["final"] = aux, final
    tmp = out / (name + ".tmp")
    # one metadata key: safetensors writes its metadata map in hash order, and a shard must come
    # out byte-identical when a killed extract redoes it
    save_file(
        tensors, str(tmp), metadata={"eagleops": json.dumps({"first_sample": first, "aux_layers": list(index.aux_layers)}, sort_keys=True)}
    )
    os.replace(tmp, out / name)
    index.shards[name] = FeatureShard(first, len(chunk), offsets[-1], (out / name).stat().st_size)
    index.write(out)


_E4M3_MAX = 448.0


def to_fp8(states: Any) -> tuple[Any, Any]:
    """[T, L, H] hidden states -> (e4m3 codes [T, L*H], float32 scales [T, L]): each token's
    vector in each layer scaled so its largest element lands on e4m3's largest (448)."""
    import torch

    scale = states.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / _E4M3_MAX
    codes = (states.float() / scale).to(torch.float8_e4m3fn)
    return codes.reshape(states.shape[0], -1).contiguous(), scale.squeeze(-1).contiguous()


def from_fp8(codes: Any, scale: Any, dtype: Any) -> Any:
    """The inverse of ``to_fp8``: [T, L*H] codes and [T, L] scales -> [T, L*H] in ``dtype``."""
    layers = scale.shape[-1]
    states = codes.float().reshape(codes.shape[0], layers, -1) * scale.float().unsqueeze(-1)
    return states.reshape(codes.shape[0], -1).to(dtype)


def open_features_index(config: RunConfig, prepared: PreparedIndex, layers: int, hidden_size: int) -> FeaturesIndex:
    """The index to resume from; a fresh one when the prepared data or the layers changed."""
    aux_layers = tuple(config.extract.aux_layers) if config.extract.aux_layers else eagle3_aux_layers(layers)
    if max(aux_layers) >= layers:
        raise ConfigError(f"{config.source}: extract.aux_layers {list(aux_layers)}: the target has only {layers} layers")
    index = FeaturesIndex.read_if_present(config.features_dir)
    storage = config.extract.storage
    if index is not None and index.prepared == prepared.fingerprint and tuple(index.aux_layers) == aux_layers and index.storage == storage:
        return index
    target = require_target(config)
    return FeaturesIndex(prepared.fingerprint, list(aux_layers), hidden_size, layers, str(target.model), storage=storage)


@dataclass
class ExtractRates:
    """Tokens computed in this run and the seconds spent in the forward pass itself."""

    started: float
    fresh_tokens: int = 0
    compute_s: float = 0.0


def extract_metrics(index: FeaturesIndex, rates: ExtractRates, device: Any) -> dict[str, Any]:
    import torch

    tokens = index.tokens
    elapsed = time.monotonic() - rates.started
    metrics: dict[str, Any] = {
        "tokens": tokens,
        "tokens_per_s": round(rates.fresh_tokens / elapsed, 1) if rates.fresh_tokens and elapsed > 0 else None,
        "forward_tokens_per_s": round(rates.fresh_tokens / rates.compute_s, 1) if rates.compute_s > 0 else None,
        "bytes_per_token": round(index.stored_bytes / tokens, 1) if tokens else None,
        "all_layers_bytes_per_token": (index.num_layers + 1) * index.hidden_size * 2 + 5,
    }
    if device.type == "cuda":
        metrics["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return metrics


class FeatureShards:
    """Random access to extracted samples without loading every shard first: a shard is opened
    (memory-mapped by safetensors) when one of its samples is asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index = FeaturesIndex.read(directory)
        self.entries: list[tuple[str, int]] = []  # (shard file, position in shard) per sample
        for name, shard in self.index.ordered_shards():
            self.entries += [(name, j) for j in range(shard.samples)]
        self._open: dict[str, Any] = {}
        self._offsets: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.index.aux_layers)

    def _handle(self, name: str) -> Any:
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
        import torch

        name, j = self.entries[i]
        handle = self._handle(name)
        a, b = self._offsets[name][j], self._offsets[name][j + 1]
        sample = {key: handle.get_slice(key)[a:b] for key in ("input_ids", "loss_mask", "aux", "final")}
        if self.index.storage == "fp8":  # back to bf16, as a bf16 shard reads
            for key in ("aux", "final"):
                sample[key] = from_fp8(sample[key], handle.get_slice(f"{key}_scale")[a:b], torch.bfloat16)
        return sample
