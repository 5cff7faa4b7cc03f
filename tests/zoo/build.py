"""Tiny random models of real targets: each keeps its target's real config.json structure
(architectures, model_type, nesting, auto_map, rope scaling, special-token ids, vocab_size),
chat template and tokenizer, with only the sizes shrunk, saved under the weight names the real
checkpoint uses. See SOURCE.md in each target's folder for where every artifact came from.

    build_tiny("qwen3-8b", tmp_path / "qwen3")   # -> a checkpoint folder transformers loads
"""

from __future__ import annotations

import copy
import json
import lzma
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ZOO = Path(__file__).parent
TARGETS = ("kimi-k2.5", "qwen3-8b", "deepseek-v3.1", "gpt-oss-20b", "llama-3.1-8b-instruct")
# Kimi-K2.5's template family without its own model: rendered with the K2.5 tokenizer
TEMPLATES_ONLY = ("kimi-k2-thinking",)

# Enough layers that EAGLE-3's aux layers [1, N//2-1, N-4] are distinct; head_dim >= 32 so
# vLLM's attention backends accept the stand-in.
TINY_LAYERS = 8
TINY_HIDDEN = 64
TINY_HEAD_DIM = 32
# What each size key becomes; a key the real config lacks is not added.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": TINY_HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": TINY_LAYERS,
    "num_attention_heads": 2,
    "head_dim": TINY_HEAD_DIM,
    # MoE: few small experts, still routed as the real model routes
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    # MLA: the low-rank projections and the split head dims
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": TINY_HEAD_DIM,
    "qk_rope_head_dim": TINY_HEAD_DIM,
    "v_head_dim": TINY_HEAD_DIM,
    "max_window_layers": TINY_LAYERS,
}
# Checkpoint formats the tiny weights are not in: the stand-in is saved unquantized
DROPPED_KEYS = ("quantization_config",)
# A multimodal wrapper's vision tower (Kimi-K2.5's MoonViT) and projector, shrunk: head width 16
# (vLLM's 2D rope splits it in four), two blocks. The real config names the tower's sizes in
# its legacy ``vt_*`` keys only.
TINY_VISION_SIZES: dict[str, Any] = {
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
    "mm_hidden_size": 32,
}
# The names transformers' Kimi_K25VisionConfig (which vLLM uses for ``kimi_k25``) reads the
# tower's sizes under; it ignores the ``vt_*`` keys, and its defaults are the real tower's sizes
# (1152, 27, 16, 4304), so the real config needs none of these names and a shrunk one needs all.
VISION_SIZE_NAMES = {
    "hidden_size": "vt_hidden_size",
    "intermediate_size": "vt_intermediate_size",
    "num_attention_heads": "vt_num_attention_heads",
    "num_hidden_layers": "vt_num_hidden_layers",
}


def real_config(target: str) -> dict[str, Any]:
    return json.loads((ZOO / target / "config.json").read_text())


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a wrapper's ``text_config``, else the config itself."""
    return config.get("text_config", config)


# DeepSeek-V3's own MLA latent sizes (kv_lora_rank 512 + qk_rope_head_dim 64 = 576): vLLM's
# MLA takes latent heads 320, 512 or 576 wide, its CPU backend 576 alone, so a stand-in vLLM
# serves keeps them
REAL_MLA_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def shrink(text: dict[str, Any], keep: dict[str, Any] | None = None) -> dict[str, Any]:
    sizes = {**TINY_SIZES, **(keep or {})}
    tiny = {key: (sizes[key] if key in sizes else value) for key, value in text.items()}
    # grouped-query attention stays grouped where the real model groups (MLA keeps kv == q heads)
    if "num_key_value_heads" in text:
        grouped = text["num_key_value_heads"] < text["num_attention_heads"]
        tiny["num_key_value_heads"] = 1 if grouped else tiny["num_attention_heads"]
    if "layer_types" in text:
        tiny["layer_types"] = text["layer_types"][:TINY_LAYERS]
    if text.get("n_group", 1) > 1:
        # DeepSeek's router keeps the best groups by their top-2 experts: 2 experts per group
        tiny["n_group"], tiny["topk_group"] = TINY_SIZES["n_routed_experts"] // 2, 2
    for key in DROPPED_KEYS:
        tiny.pop(key, None)
    return tiny


def shrink_vision(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """A vision config's sizes shrunk (the keys it has), plus the same sizes under the names
    vLLM reads (``VISION_SIZE_NAMES``); the projector's output is the shrunk text width."""
    tiny = {key: TINY_VISION_SIZES.get(key, value) for key, value in vision.items()}
    if "text_hidden_size" in vision:
        tiny["text_hidden_size"] = text_hidden
    for name, legacy in VISION_SIZE_NAMES.items():
        if legacy in vision:
            tiny[name] = tiny[legacy]
    return tiny


def tiny_config(target: str, keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """The real config.json with the text model's sizes shrunk (but those in ``keep``) and a
    vision tower's, the structure untouched but for the vision sizes vLLM reads under other
    names (``VISION_SIZE_NAMES``)."""
    config = copy.deepcopy(real_config(target))
    if "text_config" in config:
        config["text_config"] = shrink(config["text_config"], keep)
        if "vision_config" in config:
            config["vision_config"] = shrink_vision(config["vision_config"], config["text_config"]["hidden_size"])
        for key in DROPPED_KEYS:
            config.pop(key, None)
        return config
    return shrink(config, keep)


def copy_artifacts(source: Path, dest: Path) -> None:
    """Everything but the provenance notes; compressed files land decompressed."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name == "SOURCE.md" or path.is_dir():
            continue
        if path.suffix == ".xz":
            (dest / path.stem).write_bytes(lzma.decompress(path.read_bytes()))
        else:
            shutil.copyfile(path, dest / path.name)


def materialize(target: str, dest: Path) -> Path:
    """The target's artifacts alone (config, tokenizer, template, remote code) as a model
    folder would hold them, without weights: enough for AutoConfig and AutoTokenizer."""
    copy_artifacts(ZOO / target, dest)
    for module in (ZOO / target / "remote_code").glob("*.py"):
        shutil.copyfile(module, dest / module.name)
    return dest


def _random_text_model(text: dict[str, Any]) -> Any:
    """The language model the text config names, through transformers' own class for its
    model_type (Kimi's ``kimi_k2`` text model is DeepSeek-V3's architecture)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in text.items() if k not in ("auto_map", "architectures", "model_type")}
    model_type = "deepseek_v3" if text["model_type"] == "kimi_k2" else text["model_type"]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _vision_tensors(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's own tensors beside its language model: Kimi-K2.5's vision tower
    (MoonViT) and patch-merger projector, random, under the real checkpoint's names and in the
    shapes vLLM builds from the (shrunk) config, so vLLM loads the whole model as it loads the
    real one."""
    import torch

    vision = config["vision_config"]
    if "vt_hidden_size" not in vision:
        raise ValueError(f"{config['architectures']}: tiny weights are made for Kimi-K2.5's vision tower (MoonViT) only")
    width, mlp, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    generator = torch.Generator().manual_seed(1)
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (config["text_config"]["hidden_size"], merged),
        "mm_projector.proj.2.bias": (config["text_config"]["hidden_size"],),
    }
    for block in range(vision["vt_num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}"
        shapes.update({f"{prefix}.wqkv.weight": (3 * width, width), f"{prefix}.wqkv.bias": (3 * width,)})
        shapes.update({f"{prefix}.wo.weight": (width, width), f"{prefix}.wo.bias": (width,)})
        shapes.update({f"{prefix}.mlp.fc0.weight": (mlp, width), f"{prefix}.mlp.fc0.bias": (mlp,)})
        shapes.update({f"{prefix}.mlp.fc1.weight": (width, mlp), f"{prefix}.mlp.fc1.bias": (width,)})
    tensors = {name: (0.02 * torch.randn(shape, generator=generator)).bfloat16() for name, shape in shapes.items()}
    norms = [f"vision_tower.encoder.blocks.{b}.norm{n}" for b in range(vision["vt_num_hidden_layers"]) for n in (0, 1)]
    for norm in [*norms, "vision_tower.encoder.final_layernorm", "mm_projector.pre_norm"]:
        tensors[f"{norm}.weight"] = torch.ones(width, dtype=torch.bfloat16)
        tensors[f"{norm}.bias"] = torch.zeros(width, dtype=torch.bfloat16)
    return tensors


def _saved_tensors(model: Any, scratch_parent: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    scratch = scratch_parent / ".text-model"
    model.save_pretrained(str(scratch))
    tensors: dict[str, Any] = {}
    for shard in scratch.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    shutil.rmtree(scratch)
    return tensors


def save_sharded(tensors: dict[str, Any], dest: Path) -> None:
    """Two shards and an index, as the real multi-file checkpoints are laid out: the decoder
    layers in the first, embeddings, norm, head and the rest in the second."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": [n for n in names if ".layers." in n],
        "model-00002-of-00002.safetensors": [n for n in names if ".layers." not in n],
    }
    weight_map = {}
    for file_name, members in shards.items():
        save_file({n: tensors[n].contiguous() for n in members}, str(dest / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_tiny(target: str, dest: Path, keep: dict[str, Any] | None = None, pretrain: Callable[[Any, Path], None] | None = None) -> Path:
    """A loadable tiny random checkpoint of ``target`` in ``dest`` (sizes in ``keep`` as given).
    ``pretrain(model, files)``, if given, trains the text model in place before it is saved
    (``files``: the target's tokenizer and template, as AutoTokenizer loads them)."""
    dest.mkdir(parents=True, exist_ok=True)
    config = tiny_config(target, keep)
    model = _random_text_model(text_config_of(config))
    if pretrain is not None:
        pretrain(model, materialize(target, dest))
    if "text_config" in config:
        # the wrapper's names: its language model under ``language_model.``, as the real weight
        # map has it (the names save_pretrained writes are the checkpoint's, not the in-memory ones)
        tensors = {f"language_model.{name}": t for name, t in _saved_tensors(model, dest).items()}
        if "vision_config" in config:
            tensors.update(_vision_tensors(config))
        save_sharded(tensors, dest)
    else:
        model.save_pretrained(str(dest), max_shard_size="16MB")
    # the real files over what save_pretrained wrote (its generation_config.json is a default one)
    materialize(target, dest)
    (dest / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return dest
