"""export: the trained drafter as a directory SGLang (``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR``) and vLLM's EAGLE-3 loader read: ``config.json``
(``LlamaForCausalLMEagle3``, one layer, ``draft_vocab_size``, ``eagle_config``) and
``model.safetensors`` with ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``; no embeddings (the server shares the target's).

Beside it, ``drafter-speculators/``: the same weights in vllm-project/speculators' format
(``speculators_config`` naming the target as verifier; ``layers.0.*`` names), which vLLM
recognises as a speculator on its own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.training.artifacts import Checkpoint, ExportResult
from pipeline.training.context import StageContext
from pipeline.training.drafter import EXPORTED_PREFIXES, sglang_aux_layer_ids, vllm_aux_layer_ids
from pipeline.training.target import require_target

__all__ = ["export", "speculators_dir"]


def speculators_dir(config: RunConfig) -> Path:
    return config.export_dir.with_name(config.export_dir.name + "-speculators")


def _server_config(state: Checkpoint, dtype: torch.dtype) -> dict[str, Any]:
    """config.json as SGLang and vLLM read it. They want the flat pre-v5 rope fields (theta, and
    scaling only when not default), and each reads the aux layers from its own key in its own
    convention (see ``drafter_config_from_target``), written from the checkpoint's layers."""
    from transformers import LlamaConfig

    payload = LlamaConfig.from_dict(state.drafter_config).to_dict()
    payload["torch_dtype"] = str(dtype).removeprefix("torch.")
    payload["architectures"] = ["LlamaForCausalLMEagle3"]
    rope = dict(payload.get("rope_parameters") or {})
    payload["rope_theta"] = rope.get("rope_theta", payload.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    payload["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    layers = tuple(state.aux_layers)
    payload["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_aux_layer_ids(layers), "use_aux_hidden_state": True}
    payload["eagle_aux_hidden_state_layer_ids"] = vllm_aux_layer_ids(layers)
    return payload


def _speculators_config(server: dict[str, Any], verifier: Path, draft_tokens: int) -> dict[str, Any]:
    """vllm-project/speculators' Eagle3 config: what ``vllm serve DRAFTER_DIR`` auto-detects."""
    layer_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "torch_dtype")  # fmt: skip
    layer = {key: server[key] for key in layer_keys if key in server}
    layer.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=1,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": server["draft_vocab_size"],
        "target_hidden_size": server["target_hidden_size"],
        "norm_before_residual": False,  # ours normalises after the residual, as SGLang's does
        "eagle_aux_hidden_state_layer_ids": server["eagle_aux_hidden_state_layer_ids"],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        },
    }


def _write_dir(out: Path, weights: dict[str, torch.Tensor], payload: dict[str, Any]) -> None:
    """A whole export directory, renamed into place: a server never reads half of one."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(payload, indent=2, sort_keys=True))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def export(config: RunConfig, ctx: StageContext, *, dtype: torch.dtype = torch.bfloat16) -> ExportResult:
    target = require_target(config)
    state = Checkpoint.load(config.train_dir / "checkpoint.pt")
    weights = {}
    for key, value in state.drafter.items():
        if key.startswith(EXPORTED_PREFIXES) and not key.startswith("rotary"):
            weights[key] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    server = _server_config(state, dtype)
    out = config.export_dir
    _write_dir(out, weights, server)
    renamed = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v for k, v in weights.items()}
    _write_dir(speculators_dir(config), renamed, _speculators_config(server, target.model, config.eval.draft_tokens))
    size = (out / "model.safetensors").stat().st_size
    ctx.metrics(export_dir=str(out), bytes=size, tensors=len(weights), step=state.step)
    ctx.log(
        "info",
        f"export: {out} and {speculators_dir(config).name}/ ({len(weights)} tensors, {size / 2**20:.1f} MiB), trained {state.step} steps",
    )
    return ExportResult(str(out), sorted(weights), size)
