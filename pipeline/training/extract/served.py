"""extract's vLLM backend (``backend = "vllm"``): the target runs in vLLM (tensor, pipeline and data parallel
as [serve] says) and a worker extension of ours hooks its decoder layers; no transformers copy of
the target is ever loaded here. Shards, index, resume and metrics are the HF backend's own.

Prompts go in as the prepared token ids (never re-tokenised), a shard's samples in one request
of one-token completions, prefix caching off: each prompt's prefill is exactly the sample's
tokens, batched however vLLM's scheduler likes. After a shard, one ``collective_rpc`` dumps what
every worker captured with each row's token id and position, and ``assign_rows`` gives every row
back to its sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import RunError
from eagleops.pipeline.servers import vllm_capture
from eagleops.pipeline.servers.vllm import (
    VllmLaunch,
    collective_rpc,
    complete_batch,
    launch_for,
    vllm_failure,
    vllm_server,
    with_capture_extension,
)  # fmt: skip
from eagleops.pipeline.training.artifacts import FeaturesIndex, load_prepared
from eagleops.pipeline.training.context import StageContext, serving
from eagleops.pipeline.training.extract.generated import GeneratedRows, log_generated, shard_from_generate
from eagleops.pipeline.training.extract.index import ExtractRates, extract_metrics, open_features_index, shards_to_do
from eagleops.pipeline.training.features.cache import StallWatch, publish_cache, room_for_shard
from eagleops.pipeline.training.features.shards import HEADER_BYTES, shard_bytes_bound, write_feature_shard
from eagleops.pipeline.training.modeling.profile import target_profile

__all__ = ["extract_served"]

# what capture needs of vLLM's scheduler beyond the extension (see ``capture_launch``)
CAPTURE_FLAGS = ("--no-enable-chunked-prefill",)


def capture_launch(launch: VllmLaunch, ext_dir: Path, longest: int, *, multimodal: bool) -> VllmLaunch:
    """``launch`` with our capture extension (``with_capture_extension``), no chunked prefill
    (each prompt's rows come in one forward, so ``assign_rows`` can tell the prompts apart), and
    room for the ``longest`` prompt in one forward. A multimodal model is served as its language
    model only: vLLM otherwise feeds it embeddings with no token ids, and those ids are how the
    captured rows find their prompts. Our flags come last, so they win."""
    extra = (
        *CAPTURE_FLAGS,
        *(["--language-model-only"] if multimodal else []),
        "--max-model-len",
        str(longest + 1),
        "--max-num-batched-tokens",
        str(max(longest + 1, 8192)),
    )
    capture = with_capture_extension(launch, ext_dir)
    return dataclasses.replace(capture, max_model_len=0, extra_args=capture.extra_args + extra)


def _capture_server(config: RunConfig, ctx: StageContext, longest: int) -> Any:
    if config.serve is None:  # checked when the run file was read
        raise RunError("extract backend vllm needs a [serve] table")
    multimodal = target_profile(config).multimodal
    launch = capture_launch(launch_for(config), config.layout.capture_extension, longest, multimodal=multimodal)
    server = vllm_server(launch, log_path=_log_path(config), log=ctx.log, startup_timeout_s=config.serve.startup_timeout_s, max_restarts=0)
    return launch, server


def _log_path(config: RunConfig) -> Path:
    return config.layout.server_log("vllm-extract")


def assign_rows(tokens: Any, positions: Any, prompts: list[Any]) -> Any:
    """The captured row of every prompt token, prompt after prompt: [sum of lengths] indices.

    The capture server prefills each prompt whole in one forward (chunked prefill off), so a
    forward's rows are runs from position 0, one run per request: each run is given to a prompt
    still waiting with exactly its tokens (prompts with equal tokens have equal states, so which
    of them takes it does not matter). Lone rows of token 0 at position 0 that no prompt wants
    are a runner's padding."""
    import numpy as np

    tokens, positions = np.asarray(tokens), np.asarray(positions)
    by_tokens: dict[tuple[int, ...], list[int]] = {}
    for k in reversed(range(len(prompts))):
        by_tokens.setdefault(tuple(int(t) for t in prompts[k]), []).append(k)
    rows: list[Any] = [None] * len(prompts)
    starts = np.flatnonzero(np.diff(positions, prepend=-2) != 1)
    for i, end in zip(starts.tolist(), [*starts[1:].tolist(), len(positions)], strict=True):
        if positions[i] != 0:
            raise RunError(f"vLLM computed a prompt from position {int(positions[i])}, not 0: was chunked prefill or prefix caching on?")
        waiting = by_tokens.get(tuple(tokens[i:end].tolist()))
        if waiting:
            rows[waiting.pop()] = np.arange(i, end)
        elif not (end - i == 1 and tokens[i] == 0):
            raise RunError(f"vLLM computed {end - i} rows (from token {int(tokens[i])}) that no prompt of this shard waits for")
    short = [k for k, r in enumerate(rows) if r is None]
    if short:
        raise RunError(f"vLLM computed no rows for {len(short)} prompts of this shard (the first: {short[0]}): was prefix caching on?")
    return np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)


def capture_shard(
    base_url: str, model: str, chunk: list[Any], index: FeaturesIndex, dump: Path, ctx: StageContext, log_path: Path
) -> tuple[list[int], Any, Any]:
    import torch

    prompts = [ids.tolist() for ids, _ in chunk]
    offsets = [0]
    for ids in prompts:
        offsets.append(offsets[-1] + len(ids))
    with ThreadPoolExecutor(1, thread_name_prefix="eagleops-capture") as pool:
        # one request for the shard: vLLM batches its prompts; a kill while it runs stops the
        # server (the ``serving`` block), which ends the request and loses only this shard
        done = pool.submit(complete_batch, base_url, model, prompts, 1, timeout_s=max(600.0, offsets[-1] / 50))
        while not done.done():
            ctx.checkpoint()
            wait([done], timeout=0.2)
        try:
            done.result()
        except (urllib.error.URLError, TimeoutError) as exc:
            raise vllm_failure(exc, "the shard's completions", log_path) from None
    collective_rpc(base_url, log_path, "eagleops_capture_dump", str(dump))
    captured = vllm_capture.read_dump(dump)
    missing = [name for name in [*map(str, index.aux_layers), vllm_capture.FINAL, vllm_capture.TOKENS] if name not in captured]
    if missing:
        raise RunError(f"vLLM captured no {', '.join(missing)}; its log: {log_path}")
    order = torch.from_numpy(assign_rows(captured[vllm_capture.TOKENS].numpy(), captured[vllm_capture.POSITIONS].numpy(), prompts))
    # one thread for these copies: vLLM's processes hold the cores, and a team of torch threads
    # spinning against them made this gather slower than the shard's prefill (bench/RESULTS.md)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        aux = torch.cat([captured[str(layer)][order] for layer in index.aux_layers], dim=-1).to(torch.bfloat16)
        final = captured[vllm_capture.FINAL][order].to(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    return offsets, aux.contiguous(), final.contiguous()


def _shard_disk_bound(index: FeaturesIndex, chunk: list[Any]) -> int:
    """The most a shard takes in the features folder while it is made: vLLM's dump of its rows
    (float32 at worst, with int64 token ids and positions), read and deleted before the shard is
    written, or the shard."""
    tokens = sum(len(ids) for ids, _ in chunk)
    dump = tokens * (4 * index.hidden_size * (len(index.aux_layers) + 1) + 16) + HEADER_BYTES
    return max(dump, shard_bytes_bound(index, tokens, len(chunk)))


def extract_served(config: RunConfig, ctx: StageContext) -> FeaturesIndex:
    import torch

    prepared, samples = load_prepared(config.prepared_dir)
    out = config.features_dir
    out.mkdir(parents=True, exist_ok=True)
    profile = target_profile(config)
    index = open_features_index(config, prepared, profile.num_layers, profile.hidden_size)
    per = config.extract.shard_samples
    rates = ExtractRates(time.monotonic())
    stalls = StallWatch(out)
    generated = GeneratedRows.find(config, tuple(index.aux_layers))
    longest = max((len(ids) for ids, _ in samples), default=1)
    with contextlib.ExitStack() as stack:
        started: list[tuple[VllmLaunch, Any]] = []  # the capture server, once a sample needs it: none when generate captured all

        def capture_server() -> tuple[VllmLaunch, Any]:
            if not started:
                launch, server = _capture_server(config, ctx, longest)
                stack.enter_context(serving(server, ctx))
                ctx.log("info", f"extract: capturing layers {index.aux_layers} + final through vLLM on {server.base_url}")
                collective_rpc(server.base_url, _log_path(config), "eagleops_capture_start", json.dumps(index.aux_layers))
                started.append((launch, server))
            return started[0]

        def compute(part: list[Any], dump: Path) -> tuple[list[int], Any, Any]:
            launch, server = capture_server()
            t0 = time.perf_counter()
            offsets, aux, final = capture_shard(server.base_url, launch.served_name, part, index, dump, ctx, _log_path(config))
            rates.compute_s += time.perf_counter() - t0
            rates.fresh_tokens += offsets[-1]
            return offsets, aux, final

        for first, name in shards_to_do(index, out, len(samples), per):
            ctx.checkpoint()
            chunk = samples[first : first + per]
            if not room_for_shard(config, index, ctx, stalls, _shard_disk_bound(index, chunk)):
                break
            offsets, aux, final, free = shard_from_generate(generated, chunk, functools.partial(compute, dump=out / f"{name}.capture"))
            rates.generated_tokens += free
            write_feature_shard(out, name, chunk, offsets, aux, final, first, index)
            ctx.progress(index.tokens, prepared.tokens, "tokens", from_generate=rates.generated_tokens)
            publish_cache(config, index, ctx)
    index.metrics = extract_metrics(index, rates, torch.device("cpu"))
    index.metrics["backend"] = "vllm"
    index.complete = len(index.shards) * per >= len(samples)
    index.write(out)
    ctx.metrics(**index.metrics)
    ctx.progress(index.tokens, prepared.tokens, "tokens", force=True)
    ctx.log("info", f"extract (vllm): {index.tokens} tokens in {len(index.shards)} shards, {index.metrics['bytes_per_token']} B/token")
    log_generated(ctx, rates, computed_by="vLLM")
    return index
