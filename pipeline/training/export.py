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
from pathlib import Path
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.training.drafter import Eagle3Drafter
from pipeline.training.context import StageContext

__all__ = ["EXPORTED_PREFIXES", "export", "load_exported"]

EXPORTED_PREFIXES = ("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d")


def export(config: RunConfig, ctx: StageContext, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    state = torch.load(config.train_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    drafter_config = LlamaConfig.from_dict(state["drafter_config"])
    weights = {}
    for key, value in state["drafter"].items():
        if key.startswith(EXPORTED_PREFIXES) and not key.startswith("rotary"):
            weights[key] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    out = config.export_dir
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    payload = drafter_config.to_dict()
    payload["torch_dtype"] = str(dtype).removeprefix("torch.")
    payload["architectures"] = ["LlamaForCausalLMEagle3"]
    # SGLang and vLLM read the flat pre-v5 fields: theta, and scaling only when not default.
    rope = dict(payload.get("rope_parameters") or {})
    payload["rope_theta"] = rope.get("rope_theta", payload.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    payload["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    (tmp / "config.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    size = (out / "model.safetensors").stat().st_size
    ctx.metrics(export_dir=str(out), bytes=size, tensors=len(weights), step=state["step"])
    ctx.log("info", f"export: {out} ({len(weights)} tensors, {size / 2**20:.1f} MiB), trained {state['step']} steps")
    return {"dir": str(out), "tensors": sorted(weights), "bytes": size}


def load_exported(directory: Path, embeddings: torch.Tensor) -> Eagle3Drafter:
    """Rebuild a drafter from an export (as a server would), embeddings from the target."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    config = LlamaConfig.from_dict(json.loads((directory / "config.json").read_text()))
    drafter = Eagle3Drafter(config)
    weights = load_file(str(directory / "model.safetensors"))
    unexpected = [k for k in weights if not k.startswith(EXPORTED_PREFIXES)]
    if unexpected:
        raise ValueError(f"{directory}: unexpected tensors {unexpected[:5]}")
    missing = drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, strict=False).missing_keys
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
    if missing:
        raise ValueError(f"{directory}: missing tensors {missing[:5]}")
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embeddings.float())
    return drafter.eval()
