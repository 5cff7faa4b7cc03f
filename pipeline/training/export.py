"""export: the trained drafter as a directory SGLang (``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR``) and vLLM's EAGLE-3 loader read: ``config.json``
(``LlamaForCausalLMEagle3``, one layer, ``draft_vocab_size``, ``eagle_config``) and
``model.safetensors`` with ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``; no embeddings (the server shares the target's).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.training.artifacts import Checkpoint, ExportResult
from pipeline.training.context import StageContext
from pipeline.training.drafter import EXPORTED_PREFIXES

__all__ = ["export"]


def _server_config(drafter_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """config.json as SGLang and vLLM read it: they want the flat pre-v5 rope fields (theta, and
    scaling only when not default)."""
    from transformers import LlamaConfig

    payload = LlamaConfig.from_dict(drafter_config).to_dict()
    payload["torch_dtype"] = str(dtype).removeprefix("torch.")
    payload["architectures"] = ["LlamaForCausalLMEagle3"]
    rope = dict(payload.get("rope_parameters") or {})
    payload["rope_theta"] = rope.get("rope_theta", payload.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    payload["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    return payload


def export(config: RunConfig, ctx: StageContext, *, dtype: torch.dtype = torch.bfloat16) -> ExportResult:
    from safetensors.torch import save_file

    state = Checkpoint.load(config.train_dir / "checkpoint.pt")
    weights = {}
    for key, value in state.drafter.items():
        if key.startswith(EXPORTED_PREFIXES) and not key.startswith("rotary"):
            weights[key] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    out = config.export_dir
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(_server_config(state.drafter_config, dtype), indent=2, sort_keys=True))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    size = (out / "model.safetensors").stat().st_size
    ctx.metrics(export_dir=str(out), bytes=size, tensors=len(weights), step=state.step)
    ctx.log("info", f"export: {out} ({len(weights)} tensors, {size / 2**20:.1f} MiB), trained {state.step} steps")
    return ExportResult(str(out), sorted(weights), size)
