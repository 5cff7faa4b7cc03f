"""The target model as the stages need it: a device and dtype, the whole model for a forward
pass, or only its embedding and output head read from the safetensors (never the whole model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, TargetConfig
from pipeline.errors import ConfigError, InputError

__all__ = ["head_and_embeddings", "load_target", "load_target_tensors", "pick_device", "require_target", "target_shape"]


def require_target(config: RunConfig) -> TargetConfig:
    if config.target is None:
        raise ConfigError(f"{config.source}: the ML stages need a [target] table naming the target model")
    return config.target


def pick_device(target: TargetConfig) -> tuple[Any, Any]:
    """(torch.device, dtype): ``auto`` is CUDA with bf16 where it is supported, else CPU fp32."""
    import torch

    if target.device != "auto":
        device = torch.device(target.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if target.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    else:
        dtype = getattr(torch, target.dtype)
    return device, dtype


def load_target(target: TargetConfig) -> tuple[Any, Any, Any]:
    """(model in eval mode without gradients, device, dtype)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device, dtype = pick_device(target)
    if target.device_map:
        # accelerate places the layers; inputs go where the embeddings are
        model = AutoModelForCausalLM.from_pretrained(str(target.model), dtype=dtype, device_map=target.device_map)
        device = model.get_input_embeddings().weight.device
    else:
        model = AutoModelForCausalLM.from_pretrained(str(target.model), dtype=dtype)
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, device, dtype


def load_target_tensors(model_dir: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """Only the named tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors import safe_open

    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
    else:
        single = model_dir / "model.safetensors"
        if not single.exists():
            raise InputError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        with safe_open(str(single), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    found: dict[str, Any] = {}
    for name in names:
        if name in weight_map:
            with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
                found[name] = f.get_tensor(name)
    return found


def head_and_embeddings(model_dir: Path) -> tuple[Any, Any]:
    """(lm_head weight, token embedding weight); a tied head is the embedding."""
    tensors = load_target_tensors(model_dir, ("lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"))
    embed = tensors.get("model.embed_tokens.weight", tensors.get("model.language_model.embed_tokens.weight"))
    if embed is None:
        raise InputError(f"{model_dir}: no embed_tokens weight in its safetensors")
    return tensors.get("lm_head.weight", embed), embed


def target_shape(config: RunConfig) -> tuple[int, int]:
    """(layers, hidden size) from the target's config.json, without loading the model."""
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(require_target(config).model))
    text = getattr(loaded, "text_config", None) or loaded
    return int(text.num_hidden_layers), int(text.hidden_size)
