"""The target model as the stages need it: a device and dtype, its config, its own tokenizer, the
whole model for a forward pass, or only its embedding and output head read from the
safetensors (never the whole model).

Targets come wrapped too (a multimodal ``...ForConditionalGeneration`` holding the language
model, as Kimi-K2.5 does): the language model's config is the ``text_config``, and its
decoder stack, head and embeddings are found from that config and the checkpoint's weight map,
whatever the wrapper calls them. A model whose config or tokenizer is its own Python code
(``auto_map``) runs it only with ``[target] trust_remote_code``; eagleops never substitutes a
different tokenizer for the model's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig, TargetConfig
from eagleops.pipeline.errors import ConfigError, InputError

__all__ = [
    "decoder_stack",
    "is_multimodal",
    "language_model_weights",
    "load_target",
    "load_target_config",
    "load_target_tensors",
    "load_target_tokenizer",
    "pick_device",
    "raw_config",
    "require_target",
    "tensor_rows",
    "text_config_of",
    "weight_map",
]

REMOTE_CODE_KEY = "[target] trust_remote_code"


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


def _needs_remote_code(folder: Path, what: str, refused: Exception) -> ConfigError:
    return ConfigError(
        f"{folder}: its {what} is the model's own Python code (auto_map), which eagleops runs only when told to: "
        f"set `{REMOTE_CODE_KEY} = true` in the run file if you trust this model ({refused})"
    )


def _refused_for_remote_code(exc: Exception) -> bool:
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def load_target_config(target: TargetConfig) -> Any:
    """The target's transformers config (a wrapper's too: its ``text_config`` is the language model)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(target.model), trust_remote_code=target.trust_remote_code)
    except ValueError as exc:
        if _refused_for_remote_code(exc):
            raise _needs_remote_code(target.model, "config", exc) from None
        raise


def load_target_tokenizer(target: TargetConfig) -> Any:
    """The model's own tokenizer. One its tokenizer_config.json names as code (``auto_map``) is
    loaded only with the opt-in, and must come back as that class: transformers would otherwise
    build a generic tokenizer from the vocabulary file, whose splits are not the model's."""
    from transformers import AutoTokenizer

    folder = target.tokenizer_path
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.exists() else {}
    own_class = (settings.get("auto_map") or {}).get("AutoTokenizer")
    own_class = own_class[0] if isinstance(own_class, list) else own_class
    if own_class and not target.trust_remote_code:
        raise _needs_remote_code(folder, f"tokenizer ({own_class})", ValueError("not trusted"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=target.trust_remote_code)
    if own_class and type(tokenizer).__name__ != own_class.rsplit(".", 1)[-1]:
        raise InputError(f"{folder}: loaded {type(tokenizer).__name__} instead of the model's own {own_class}")
    return tokenizer


def load_target(target: TargetConfig) -> tuple[Any, Any, Any]:
    """(model in eval mode without gradients, device, dtype)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device, dtype = pick_device(target)
    options: dict[str, Any] = {"dtype": dtype, "trust_remote_code": target.trust_remote_code}
    if target.device_map:
        options["device_map"] = target.device_map  # accelerate places the layers
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target.model), **options)
    except ValueError as exc:
        if _refused_for_remote_code(exc):
            raise _needs_remote_code(target.model, "model class", exc) from None
        raise
    if target.device_map:
        device = model.get_input_embeddings().weight.device  # inputs go where the embeddings are
    else:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, device, dtype


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json: a wrapper's ``text_config`` (or another
    nested table with the decoder's sizes), else the config itself."""
    if "text_config" in raw:
        return raw["text_config"]
    for value in raw.values():
        if isinstance(value, dict) and {"num_hidden_layers", "hidden_size", "vocab_size"} <= value.keys():
            return value
    return raw


def raw_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.exists():
        raise InputError(f"{model_dir}: no config.json")
    return json.loads(path.read_text())


def is_multimodal(raw: dict[str, Any]) -> bool:
    """Whether vLLM serves the model of config.json ``raw`` as a multimodal model: it has a vision
    tower's config, or names a ``...ForConditionalGeneration`` wrapper of a ``text_config``."""
    wrapper = any(str(name).endswith("ForConditionalGeneration") for name in raw.get("architectures") or [])
    return "vision_config" in raw or (wrapper and "text_config" in raw)


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (in ``model_dir``) holding it."""
    from safetensors import safe_open

    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        return json.loads(index_file.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise InputError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def load_target_tensors(model_dir: Path, files: dict[str, str]) -> dict[str, Any]:
    """Only the named tensors (name -> the file holding it) of a safetensors checkpoint."""
    from safetensors import safe_open

    found: dict[str, Any] = {}
    for name, file in files.items():
        with safe_open(str(model_dir / file), framework="pt") as f:
            found[name] = f.get_tensor(name)
    return found


def language_model_weights(weights: dict[str, str], num_layers: int, model_dir: Path) -> tuple[str, str]:
    """(head, embeddings) tensor names of the language model in the weight map ``weights``,
    wherever a wrapper puts it: the embeddings are the ``embed_tokens`` beside the decoder stack
    of ``num_layers`` layers (``<prefix>layers.<last>.``), the head the ``lm_head`` nearest them;
    a tied head is the embeddings."""
    last_layer = num_layers - 1
    stacks = [n.removesuffix("embed_tokens.weight") for n in weights if n.endswith("embed_tokens.weight")]
    prefixes = [p for p in stacks if any(n.startswith(f"{p}layers.{last_layer}.") for n in weights)]
    if not prefixes:
        raise InputError(f"{model_dir}: no embed_tokens weight beside a {last_layer + 1}-layer decoder stack in its safetensors")
    embeddings = prefixes[0] + "embed_tokens.weight"
    heads = [n for n in weights if n.endswith("lm_head.weight")]
    if not heads:
        return embeddings, embeddings

    def shared_prefix(name: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(name, embeddings, strict=False)) if a != b), min(len(name), len(embeddings)))

    return max(heads, key=shared_prefix), embeddings


def tensor_rows(file: Path, name: str) -> int:
    """The first dimension of tensor ``name`` in safetensors ``file``, from its header alone."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return int(f.get_slice(name).get_shape()[0])


def decoder_stack(model: Any) -> Any:
    """The module holding the language model's embeddings, decoder layers and final norm (what
    ``model.model`` is for a plain ``...ForCausalLM``), found in any wrapper by its shape: the
    module whose ``layers`` are the text config's ``num_hidden_layers``."""
    text = getattr(model.config, "text_config", None) or model.config
    for _, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if hasattr(module, "embed_tokens") and layers is not None and len(layers) == text.num_hidden_layers:
            return module
    raise InputError(f"{type(model).__name__}: no decoder stack of {text.num_hidden_layers} layers with embed_tokens")
