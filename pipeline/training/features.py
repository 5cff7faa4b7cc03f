"""Extracted features, read lazily: a shard is memory-mapped (safetensors) when one of its
samples is first asked for, so training's step 1 does not wait for every file to be read."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import ConfigError, RunError
from pipeline.training.artifacts import FeatureShard, FeaturesIndex, PreparedIndex
from pipeline.training.drafter import eagle3_aux_layers
from pipeline.training.feature_cache import ConsumedShards, forget_consumed
from pipeline.training.target import require_target

__all__ = [
    "ExtractRates",
    "FeatureShards",
    "extract_metrics",
    "from_fp8",
    "to_fp8",
    "features_layout",
    "index_layout",
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
    consumed = set(ConsumedShards.read(out, index.prepared).shards)  # trained on and deleted: done
    return [(first, name) for first, name in todo if not (name in index.shards and ((out / name).exists() or name in consumed))]


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


def features_layout(config: RunConfig, prepared: str, layers: int) -> tuple[str, tuple[int, ...], str, int]:
    """What extract's features of ``prepared`` are for this run file: (prepared, aux layers,
    storage, samples per shard). An index with another layout holds other features."""
    aux_layers = tuple(config.extract.aux_layers) if config.extract.aux_layers else eagle3_aux_layers(layers)
    if max(aux_layers) >= layers:
        raise ConfigError(f"{config.source}: extract.aux_layers {list(aux_layers)}: the target has only {layers} layers")
    return prepared, aux_layers, config.extract.storage, config.extract.shard_samples


def index_layout(index: FeaturesIndex) -> tuple[str, tuple[int, ...], str, int | None]:
    return index.prepared, tuple(index.aux_layers), index.storage, index.shard_samples


def open_features_index(config: RunConfig, prepared: PreparedIndex, layers: int, hidden_size: int) -> FeaturesIndex:
    """The index to resume from; a fresh one when the prepared data or the layout changed.
    Written at once (before any model loads): a train following this extract learns the layout
    from it, and must not take an older index for this one."""
    layout = features_layout(config, prepared.fingerprint, layers)
    index = FeaturesIndex.read_if_present(config.features_dir)
    if index is not None and index.shard_samples is None:  # an index from before the layout was recorded
        index.shard_samples = layout[3]
    if index is None or index_layout(index) != layout:
        target = require_target(config)
        index = FeaturesIndex(prepared.fingerprint, list(layout[1]), hidden_size, layers, str(target.model), storage=layout[2])
        index.shard_samples = layout[3]
        forget_consumed(config.features_dir)  # the trained-on record of older features
    elif not config.extract.max_cache_gb:
        forget_consumed(config.features_dir)  # unbounded: shards a bounded train deleted are made again
    index.samples = prepared.samples
    index.run_token = os.urandom(8).hex()
    index.write(config.features_dir)
    return index


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
    (memory-mapped by safetensors) when one of its samples is asked for.

    Following an extract that is still writing (``follow``: the stage context), the layout comes
    from the index extract writes first, and a sample whose shard is not written yet waits for it."""

    def __init__(self, directory: Path, *, follow: Any = None, layout: tuple[Any, ...] = ()):
        self.directory = directory
        self.follow = follow
        self.waiting_for: str | None = None  # the shard a following read waits on, if any
        self._logged_wait = -1e9
        self.index = self._following_index(layout) if follow is not None else FeaturesIndex.read(directory)
        self.entries: list[tuple[str, int]] = []  # (shard file, position in shard) per sample
        if follow is None:
            for name, shard in self.index.ordered_shards():
                self.entries += [(name, j) for j in range(shard.samples)]
        self._open: dict[str, Any] = {}
        self._offsets: dict[str, list[int]] = {}

    def _following_index(self, layout: tuple[Any, ...]) -> FeaturesIndex:
        """The index of the features this run file makes, once extract has written it."""
        while True:
            index = FeaturesIndex.read_if_present(self.directory)
            if index is not None and index_layout(index) == layout and index.samples is not None:
                self.waiting_for = None
                return index
            self._wait("index.json")

    def _reread(self) -> None:
        index = FeaturesIndex.read_if_present(self.directory)
        if index is None:
            return
        if index_layout(index) != index_layout(self.index):
            raise RunError(f"{self.directory}: extract started over with other features under this train; train again")
        self.index = index

    def _wait(self, what: str) -> None:
        if self.waiting_for is None and time.monotonic() - self._logged_wait > 60:  # not a line per shard
            self.follow.log("info", f"{self.follow.stage}: waiting for extract to write {what}")
            self._logged_wait = time.monotonic()
        self.waiting_for = what
        self.follow.checkpoint()
        time.sleep(0.25)

    def __len__(self) -> int:
        return self.index.samples if self.follow is not None and self.index.samples is not None else len(self.entries)

    @property
    def per_shard(self) -> int:
        return self.index.shard_samples or max(1, len(self.entries))

    def _locate(self, i: int) -> tuple[str, int]:
        if self.follow is None:
            return self.entries[i]
        k, j = divmod(i, self.per_shard)
        name = shard_name(k)
        while name not in self.index.shards or not (self.directory / name).exists():
            if name in self.index.shards and name in ConsumedShards.read(self.directory, self.index.prepared).shards:
                raise RunError(
                    f"{self.directory / name}: deleted after a train checkpointed past it (extract.max_cache_gb); "
                    f"to train again from the start, delete {self.directory / 'consumed.json'} and extract again"
                )
            if self.index.complete and name not in self.index.shards:
                raise RunError(f"{self.directory}: {name} is not in the index though extract has finished")
            self._wait(name)  # not listed yet, or listed and not visible yet (shared storage lags)
            self._reread()
        self.waiting_for = None
        return name, j

    def wait_for(self, i: int) -> None:
        """Block until sample ``i`` can be read (following extract)."""
        if self.follow is not None:
            self._locate(i)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.index.aux_layers)

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self._open:
            # following, reads go shard by shard: holding only the newest two lets a deleted
            # shard's disk space go (an open map keeps an unlinked file's blocks)
            if len(self._open) > (1 if self.follow is not None else 8):
                dropped = next(iter(self._open))
                self._open.pop(dropped)
                self._offsets.pop(dropped, None)
            handle = safe_open(str(self.directory / name), framework="pt")
            self._open[name] = handle
            self._offsets[name] = handle.get_tensor("offsets").tolist()
        return self._open[name]

    def length(self, i: int) -> int:
        name, j = self._locate(i)
        self._handle(name)
        offsets = self._offsets[name]
        return offsets[j + 1] - offsets[j]

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        name, j = self._locate(i)
        handle = self._handle(name)
        a, b = self._offsets[name][j], self._offsets[name][j + 1]
        sample = {key: handle.get_slice(key)[a:b] for key in ("input_ids", "loss_mask", "aux", "final")}
        if self.index.storage == "fp8":  # back to bf16, as a bf16 shard reads
            for key in ("aux", "final"):
                sample[key] = from_fp8(sample[key], handle.get_slice(f"{key}_scale")[a:b], torch.bfloat16)
        return sample
