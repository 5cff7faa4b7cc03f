"""extract's HF backend: the target in transformers, over every prepared sample, keeping what
EAGLE-3 trains on.

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

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.training.artifacts import FeaturesIndex, load_prepared
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.extract.generated import GeneratedRows, log_generated, shard_from_generate
from eagleops.pipeline.training.extract.index import ExtractRates, extract_metrics, open_features_index, shards_to_do
from eagleops.pipeline.training.features.cache import StallWatch, publish_cache, room_for_shard
from eagleops.pipeline.training.features.shards import shard_bytes_bound, write_feature_shard
from eagleops.pipeline.training.modeling.layers import engine_layer_ids
from eagleops.pipeline.training.modeling.profile import target_profile
from eagleops.pipeline.training.modeling.target import decoder_stack, load_target, require_target

__all__ = ["extract_hf", "forward_features", "length_batches", "pad_batch"]


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
        out = decoder_stack(model)(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states  # [embeddings, layer 0 out, ..., layer N-1 out (post-norm)]
        aux = torch.cat([hidden[i] for i in engine_layer_ids(aux_layers, "hf")], dim=-1)
        final = out.last_hidden_state
        if dtype is not None:
            aux, final = aux.to(dtype), final.to(dtype)
    return aux, final


def _compute_shard(
    model: Any,
    device: Any,
    chunk: list[Any],
    index: FeaturesIndex,
    config: RunConfig,
    ctx: StageContext,
    progress: tuple[int, int],
    rates: ExtractRates,
) -> tuple[list[int], Any, Any]:
    """(offsets, aux [T, 3H], final [T, H]) of one shard, filled in place batch by batch (no
    per-sample copies, no concatenation)."""
    import torch

    offsets = [0]
    for ids, _ in chunk:
        offsets.append(offsets[-1] + len(ids))
    aux_out = torch.empty((offsets[-1], len(index.aux_layers) * index.hidden_size), dtype=torch.bfloat16)
    final_out = torch.empty((offsets[-1], index.hidden_size), dtype=torch.bfloat16)
    done_before, total = progress
    for batch in length_batches([len(ids) for ids, _ in chunk], config.extract.batch_tokens):
        ctx.checkpoint()
        t0 = time.perf_counter()
        aux, final = forward_features(model, [chunk[i][0] for i in batch], index.aux_layers, device, torch.bfloat16)
        aux, final = aux.cpu(), final.cpu()
        for row, i in enumerate(batch):
            n = offsets[i + 1] - offsets[i]
            aux_out[offsets[i] : offsets[i + 1]] = aux[row, :n]
            final_out[offsets[i] : offsets[i + 1]] = final[row, :n]
        rates.compute_s += time.perf_counter() - t0
        rates.fresh_tokens += sum(len(chunk[i][0]) for i in batch)
        ctx.progress(done_before + rates.fresh_tokens, total, "tokens")
    return offsets, aux_out, final_out


def extract_hf(config: RunConfig, ctx: StageContext) -> FeaturesIndex:
    target = require_target(config)
    prepared, samples = load_prepared(config.prepared_dir)
    out = config.features_dir
    out.mkdir(parents=True, exist_ok=True)
    profile = target_profile(config)
    index = open_features_index(config, prepared, profile.num_layers, profile.hidden_size)  # before the model loads (minutes, at scale)
    generated = GeneratedRows.find(config, tuple(index.aux_layers))
    loaded: list[Any] = []  # the target, loaded once a sample needs it: none when generate captured all

    def target_model() -> tuple[Any, Any]:
        if not loaded:
            loaded.extend(load_target(target)[:2])
        return loaded[0], loaded[1]

    per = config.extract.shard_samples
    rates = ExtractRates(time.monotonic())
    done_tokens = index.tokens
    # Shards are written by one background thread while the next one computes; at most one write
    # is in flight, and a shard enters the index only once renamed into place.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
    stalls = StallWatch(out)
    pending: Future[None] | None = None
    try:
        for first, name in shards_to_do(index, out, len(samples), per):
            ctx.checkpoint()
            if config.extract.max_cache_gb and pending is not None:
                pending.result()  # the shard in flight counts against the bound
            chunk = samples[first : first + per]
            if not room_for_shard(config, index, ctx, stalls, shard_bytes_bound(index, sum(len(ids) for ids, _ in chunk), len(chunk))):
                break
            progress = (done_tokens, prepared.tokens)
            offsets, aux, final, free = shard_from_generate(
                generated, chunk, lambda part, at=progress: _compute_shard(*target_model(), part, index, config, ctx, at, rates)
            )
            rates.generated_tokens += free
            done_tokens += free
            ctx.progress(done_tokens + rates.fresh_tokens, prepared.tokens, "tokens", from_generate=rates.generated_tokens)
            if pending is not None:
                pending.result()
                publish_cache(config, index, ctx)
            pending = writer.submit(write_feature_shard, out, name, chunk, offsets, aux, final, first, index)
        if pending is not None:
            pending.result()
            publish_cache(config, index, ctx)
    finally:
        writer.shutdown(wait=True)
    index.metrics = extract_metrics(index, rates, loaded[1] if loaded else _cpu())
    index.complete = len(index.shards) * per >= len(samples)
    index.write(out)
    ctx.metrics(**index.metrics)
    ctx.progress(index.tokens, prepared.tokens, "tokens", force=True)
    bpt, all_layers = index.metrics["bytes_per_token"], index.metrics["all_layers_bytes_per_token"]
    ctx.log("info", f"extract: {index.tokens} tokens in {len(index.shards)} shards, {bpt} B/token (all layers would be {all_layers})")
    log_generated(ctx, rates, computed_by="the target in transformers")
    return index


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
