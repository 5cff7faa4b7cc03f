"""export: the trained drafter as a directory SGLang (``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR``) and vLLM's EAGLE-3 loader read: ``config.json``
(``LlamaForCausalLMEagle3``, one layer, ``draft_vocab_size``, ``eagle_config``) and
``model.safetensors`` with ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``; no embeddings (the server shares the target's). EAGLE-3.1 adds
``fc_norm.{0,1,2}.weight`` and the ``fc_norm``/``norm_output`` keys vLLM reads; an MLA drafter is
``Eagle3DeepseekV2ForCausalLM`` (``model_type: deepseek_v2``) with DeepSeek's attention names.
Both engines load every kind (``drafter_config.SERVING_ENGINES``); the log says which load this
one (SGLang cannot name aux layers starting at 0 on DeepSeek-family targets: a warning says so).

Beside it, ``drafter-speculators/``: the same weights in vllm-project/speculators' format
(``speculators``), which vLLM recognises as a speculator on its own (not for MLA drafters).

The aux layers written are the checkpoint's, which must be those of the features extract wrote
last: a drafter exported from an older extract's layers would read the wrong hidden states.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eagleops.pipeline.config import BLOCK_DRAFTERS, RunConfig
from eagleops.pipeline.training.artifacts import Checkpoint, ExportResult, features_capture
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.export.speculators import speculators_config, speculators_dir, speculators_weights
from eagleops.pipeline.training.modeling.dflash import EXPORTED_DFLASH_PREFIXES
from eagleops.pipeline.training.modeling.dflash_config import is_dflash
from eagleops.pipeline.training.modeling.drafter import EXPORTED_PREFIXES
from eagleops.pipeline.training.modeling.drafter_config import drafter_kind, exported_config, serving_engines, sglang_unservable
from eagleops.pipeline.training.modeling.profile import target_profile
from eagleops.pipeline.training.modeling.rope import legacy_engine_warning
from eagleops.pipeline.training.modeling.target import require_target

__all__ = ["export"]


def _check_against_features(config: RunConfig, checkpoint: Path, state: Checkpoint) -> None:
    """The checkpoint's layers must be the features' (when they are still there to ask)."""
    found = features_capture(config.features_dir)
    if found is not None:
        features, index_file = found
        state.capture.require_match(
            checkpoint,
            features,
            index_file,
            "the features were extracted again with other layers since this train; train again before exporting",
        )


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
    checkpoint = config.layout.checkpoint
    state = Checkpoint.load(checkpoint)
    _check_against_features(config, checkpoint, state)
    weights = {}
    prefixes = EXPORTED_DFLASH_PREFIXES if is_dflash(state.drafter_config) else EXPORTED_PREFIXES
    for key, value in state.drafter.items():
        if key.startswith(prefixes) and not key.startswith("rotary"):
            weights[key] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    server = exported_config(state.drafter_config, state.capture, str(dtype).removeprefix("torch."))
    note = legacy_engine_warning(server["rope_scaling"])
    if note:
        ctx.log("warning", f"export: {note}")
    out = config.export_dir
    _write_dir(out, weights, server)
    kind, engines = drafter_kind(server), serving_engines(server)
    if why := sglang_unservable(server):
        ctx.log("warning", f"export: not for SGLang: {why}")
    written = [out.name + "/"]
    if kind.startswith("mla") or kind in BLOCK_DRAFTERS:
        # vLLM's speculators reader maps only Llama and Qwen3 layers to an EAGLE-3 drafter class: an
        # MLA layer there would load as Llama attention, a DFlash drafter as EAGLE-3; so no such
        # directory is written (nor an old one kept)
        shutil.rmtree(speculators_dir(config), ignore_errors=True)
        ctx.log("info", f"export: no {speculators_dir(config).name}/ for a {kind} drafter (vLLM reads it as EAGLE-3)")
    else:
        _write_dir(
            speculators_dir(config),
            speculators_weights(weights),
            speculators_config(server, state.capture, target.model, target_profile(config).architectures, config.eval.draft_tokens),
        )
        written.append(speculators_dir(config).name + "/")
    size = (out / "model.safetensors").stat().st_size
    ctx.metrics(export_dir=str(out), bytes=size, tensors=len(weights), step=state.step, drafter=kind, engines=list(engines))
    ctx.log(
        "info",
        f"export: {' and '.join(written)} ({kind}, {len(weights)} tensors, {size / 2**20:.1f} MiB), trained {state.step} steps; "
        f"loads in {' and '.join(engines)}",
    )
    return ExportResult(str(out), sorted(weights), size)
