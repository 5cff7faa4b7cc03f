"""The features index as extract keeps it: resumed, or begun afresh when the run file asks for
other features; the shards still to write; the rates it records when it ends."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.training.artifacts import FeaturesIndex, PreparedIndex
from eagleops.pipeline.training.features.cache import ConsumedShards, forget_consumed
from eagleops.pipeline.training.features.layout import FeatureSet, capture_for_run
from eagleops.pipeline.training.features.shards import shard_name
from eagleops.pipeline.training.modeling.target import require_target

__all__ = ["ExtractRates", "extract_metrics", "open_features_index", "shards_to_do"]


def shards_to_do(index: FeaturesIndex, out: Path, samples: int, per_shard: int) -> list[tuple[int, str]]:
    """(first sample, shard file) of every shard not yet written: where a resumed extract starts."""
    todo = [(first, shard_name(first // per_shard)) for first in range(0, samples, per_shard)]
    consumed = set(ConsumedShards.read(out, index.prepared).shards)  # trained on and deleted: done
    return [(first, name) for first, name in todo if not (name in index.shards and ((out / name).exists() or name in consumed))]


def open_features_index(config: RunConfig, prepared: PreparedIndex, layers: int, hidden_size: int) -> FeaturesIndex:
    """The index to resume from; a fresh one when the prepared data or the features asked for
    changed. Written at once (before any model loads): a train following this extract learns the
    layout from it, and must not take an older index for this one. This is where the capture
    layout is written, the one record of it every later stage checks against."""
    capture = capture_for_run(config, layers, hidden_size)
    wanted = FeatureSet(prepared.fingerprint, capture.aux_layers, config.extract.storage, config.extract.shard_samples)
    index = FeaturesIndex.read_if_present(config.features_dir)
    if index is not None and index.shard_samples is None:  # an index from before the layout was recorded
        index.shard_samples = wanted.shard_samples
    if index is None or FeatureSet.of(index) != wanted:
        target = require_target(config)
        index = FeaturesIndex(
            prepared.fingerprint, list(capture.aux_layers), hidden_size, layers, str(target.model), storage=wanted.storage
        )
        index.shard_samples = wanted.shard_samples
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
    generated_tokens: int = 0  # rows that came with generate (during_generate): not computed here


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
        "tokens_from_generate": rates.generated_tokens,
        "tokens_computed": rates.fresh_tokens,
    }
    if device.type == "cuda":
        metrics["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return metrics
