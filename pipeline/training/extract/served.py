"""extract's vLLM backend (``backend = "vllm"``): the target runs in vLLM (tensor, pipeline and data parallel
as [serve] says) and a worker extension of ours hooks its decoder layers; no transformers copy of
the target is ever loaded here. Shards, index, resume and metrics are the HF backend's own.

Prompts go in as the prepared token ids (never re-tokenised), one at a time, prefix caching off,
each as a one-token completion: its prefill is exactly the sample's tokens. After a shard's
samples, one ``collective_rpc`` dumps what every worker captured, and it is cut by the offsets.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import RunError
from pipeline.servers import vllm_capture
from pipeline.servers.vllm import complete_ids, launch_for, vllm_server
from pipeline.training.artifacts import FeaturesIndex, load_prepared
from pipeline.training.context import StageContext, serving
from pipeline.training.extract.index import ExtractRates, extract_metrics, open_features_index, shards_to_do
from pipeline.training.features.cache import StallWatch, publish_cache, room_for_shard
from pipeline.training.features.shards import write_feature_shard
from pipeline.training.modeling.target import target_shape

__all__ = ["extract_served"]

EXTENSION = "eagleops_vllm_capture"


def _rpc(base_url: str, method: str, *args: str) -> list[Any]:
    body = json.dumps({"method": method, "args": list(args)}).encode()
    request = urllib.request.Request(f"{base_url}/collective_rpc", data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        return list(json.loads(response.read())["results"])


def _capture_server(config: RunConfig, ctx: StageContext) -> Any:
    """vLLM with our capture extension on its path, eager (hooks need eager modules), no prefix
    cache (a cached prefix would not be computed, so not captured)."""
    serve = config.serve
    if serve is None:  # checked when the run file was read
        raise RunError("extract backend vllm needs a [serve] table")
    ext_dir = config.output_dir / "servers" / "ext"
    ext_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vllm_capture.__file__, ext_dir / f"{EXTENSION}.py")
    launch = launch_for(config)
    extra = (
        "--worker-extension-cls",
        f"{EXTENSION}.HiddenStateCapture",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "1",
    )
    env = {**launch.env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ext_dir)}
    launch = dataclasses.replace(launch, extra_args=launch.extra_args + extra, env=env)
    log_path = config.output_dir / "servers" / "vllm-extract.log"
    return launch, vllm_server(launch, log_path=log_path, log=ctx.log, startup_timeout_s=serve.startup_timeout_s, max_restarts=0)


def _capture_shard(
    base_url: str, model: str, chunk: list[Any], index: FeaturesIndex, dump: Path, ctx: StageContext
) -> tuple[list[int], Any, Any]:
    import torch

    offsets = [0]
    for ids, _ in chunk:
        ctx.checkpoint()  # a kill here loses only this shard's captures (the server goes with it)
        complete_ids(base_url, model, ids.tolist(), 1)
        offsets.append(offsets[-1] + len(ids))
    _rpc(base_url, "eagleops_capture_dump", str(dump))
    captured = vllm_capture.read_dump(dump)
    missing = [name for name in [*map(str, index.aux_layers), vllm_capture.FINAL] if name not in captured]
    if missing:
        raise RunError(f"vLLM captured no {', '.join(missing)} (see servers/vllm-extract.log)")
    rows = captured[vllm_capture.FINAL].shape[0]
    if rows != offsets[-1]:
        raise RunError(f"vLLM computed {rows} token rows for {offsets[-1]} prompt tokens: is prefix caching or padding on?")
    aux = torch.cat([captured[str(layer)] for layer in index.aux_layers], dim=-1).to(torch.bfloat16)
    return offsets, aux.contiguous(), captured[vllm_capture.FINAL].to(torch.bfloat16).contiguous()


def extract_served(config: RunConfig, ctx: StageContext) -> FeaturesIndex:
    import torch

    prepared, samples = load_prepared(config.prepared_dir)
    out = config.features_dir
    out.mkdir(parents=True, exist_ok=True)
    index = open_features_index(config, prepared, *target_shape(config))
    per = config.extract.shard_samples
    rates = ExtractRates(time.monotonic())
    stalls = StallWatch(out)
    launch, server = _capture_server(config, ctx)
    with serving(server, ctx):
        ctx.log("info", f"extract: capturing layers {index.aux_layers} + final through vLLM on {server.base_url}")
        _rpc(server.base_url, "eagleops_capture_start", json.dumps(index.aux_layers))
        for first, name in shards_to_do(index, out, len(samples), per):
            ctx.checkpoint()
            if not room_for_shard(config, index, ctx, stalls):
                break
            chunk = samples[first : first + per]
            t0 = time.perf_counter()
            offsets, aux, final = _capture_shard(server.base_url, launch.served_name, chunk, index, out / f"{name}.capture", ctx)
            rates.compute_s += time.perf_counter() - t0
            rates.fresh_tokens += offsets[-1]
            write_feature_shard(out, name, chunk, offsets, aux, final, first, index)
            ctx.progress(index.tokens, prepared.tokens, "tokens")
            publish_cache(config, index, ctx)
    index.metrics = extract_metrics(index, rates, torch.device("cpu"))
    index.metrics["backend"] = "vllm"
    index.complete = len(index.shards) * per >= len(samples)
    index.write(out)
    ctx.metrics(**index.metrics)
    ctx.progress(index.tokens, prepared.tokens, "tokens", force=True)
    ctx.log("info", f"extract (vllm): {index.tokens} tokens in {len(index.shards)} shards, {index.metrics['bytes_per_token']} B/token")
    return index
