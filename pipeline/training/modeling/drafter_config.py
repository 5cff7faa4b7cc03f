"""The drafter's config, built in one place: the ``LlamaConfig`` we train with (and checkpoint)
says the drafter's kind (``drafter``) and the layers it reads in our own numbering
(``aux_layers``); the ``config.json`` SGLang and vLLM load from an export names those layers in
the engines' numbering instead, written by ``_engine_layer_fields`` alone at export;
``exported_capture`` reads them back.

SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids``; vLLM reads the top-level key
first. Each is in its engine's own numbering (``modeling.layers``).

The drafter's shape (``[train] drafter`` and the ``drafter_*`` overrides) is chosen here for
each target family; every size left at 0 is chosen as follows, and the README says the same:

- Llama attention on a GQA/MHA target (Llama, Qwen3, gpt-oss): the target's heads, KV heads and
  head dim, as SpecForge's configs for these targets do.
- Llama attention on an MLA target (DeepSeek-V3, Kimi): ``head_dim = v_head_dim`` (128), as many
  heads as fill the hidden size (56 at 7168) and 8 KV heads: SpecForge's DeepSeek-V3 drafter
  (configs/deepseek-v3-671b-eagle3.json; its Kimi-K2 config is 64 x 128 with 64 KV heads, 8x the
  KV cache for an attention wider than the hidden size). MLA's own head count (64 or 128 heads of
  192-wide q/k) would make a drafter 2-4x the attention width.
- MLA attention on an MLA target: the target's latent sizes (``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope/rope_head_dim``, ``v_head_dim``), heads filling the hidden size as above; on another
  target, DeepSeek's ratios to the target's head dim d (nope d, rope d/2, v d, kv latent 4d but
  at most hidden/8, q latent 3x the kv latent). Its RoPE is the target's when the target is MLA
  (DeepSeek's yarn, which vLLM's MLA reads as ``deepseek_yarn``); otherwise plain RoPE with the
  target's theta, the only kind vLLM's MLA layer computes as trained.
- The MLP: the target's dense ``intermediate_size``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import BLOCK_DRAFTERS, DRAFTERS, TrainConfig
from eagleops.pipeline.errors import ConfigError, InputError
from eagleops.pipeline.training.artifacts import CaptureLayout
from eagleops.pipeline.training.modeling.dflash_config import dflash_config_from_target, exported_dflash_config, is_dflash
from eagleops.pipeline.training.modeling.layers import (
    drafter_layer_count,
    engine_layer_ids,
    layers_from_engine_ids,
    layers_from_sglang_ids,
    sglang_layer_ids,
)
from eagleops.pipeline.training.modeling.rope import engine_rope_scaling

__all__ = [
    "ARCHITECTURE",
    "MLA_ARCHITECTURE",
    "DrafterChoice",
    "drafter_config_from_target",
    "drafter_kind",
    "drafting",
    "exported_capture",
    "exported_config",
    "geometry_mismatches",
    "serving_engines",
    "sglang_unservable",
]

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the class name both servers dispatch an EAGLE-3 drafter on
# vLLM's EAGLE-3 drafter with DeepSeek's MLA (deepseek_eagle3.py), on a DeepseekV2Config: vLLM takes
# any draft whose model_type is deepseek_v3 for DeepSeek's own MTP layer (SpeculativeConfig.
# hf_config_override) and fails "Eagle3DeepSeekMTPModel are not supported"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# what a resumed checkpoint must share with the drafter built now
GEOMETRY_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "draft_vocab_size", "fc_norm", "norm_output", "num_hidden_layers", "block_size", "mask_token_id",
                 *MLA_KEYS)  # fmt: skip
# The engines whose loaders read every kind as trained (their sources: vLLM 0.32/0.33
# llama_eagle3.py and deepseek_eagle3.py; SGLang 0.5.23 llama_eagle3.py and kimi_k25_eagle3.py,
# whose Eagle3DeepseekV2ForCausalLM is Kimi's MLA drafter): both read fc_norm and norm_output
SERVING_ENGINES = ("sglang", "vllm")
_ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")  # what exported_config writes of the rope, every kind
KV_HEADS_ON_MLA_TARGETS = 8  # SpecForge's DeepSeek-V3 drafter's


@dataclass(frozen=True)
class DrafterChoice:
    """``[train]``'s drafter settings: the kind and each size (0: chosen for the target)."""

    kind: str = "eagle3"
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    kv_lora_rank: int = 0
    layers: int = 1
    block_size: int = 16  # dflash's

    def __post_init__(self) -> None:
        if self.kind not in DRAFTERS:
            raise ConfigError(f"train.drafter: {self.kind!r} is not one of {', '.join(DRAFTERS)}")

    @classmethod
    def from_train(cls, train: TrainConfig) -> DrafterChoice:
        return cls(train.drafter, train.drafter_heads, train.drafter_kv_heads, train.drafter_head_dim,
                   train.drafter_intermediate_size, train.drafter_kv_lora_rank, drafter_layer_count(train),
                   train.block_size)  # fmt: skip

    @property
    def mla(self) -> bool:
        return self.kind.startswith("mla")

    @property
    def block(self) -> bool:
        return self.kind in BLOCK_DRAFTERS

    @property
    def eagle31(self) -> bool:
        return self.kind.endswith("3.1")


def _is_mla(text: Any) -> bool:
    return getattr(text, "kv_lora_rank", None) is not None


def _target_head_dim(text: Any) -> int:
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _llama_attention(text: Any, choice: DrafterChoice) -> dict[str, Any]:
    hidden = text.hidden_size
    if _is_mla(text):
        head_dim = choice.head_dim or int(text.v_head_dim)
        heads = choice.heads or max(1, hidden // head_dim)
        kv_heads = choice.kv_heads or math.gcd(heads, KV_HEADS_ON_MLA_TARGETS)
    else:
        head_dim = choice.head_dim or _target_head_dim(text)
        same_heads = not choice.head_dim or choice.head_dim == _target_head_dim(text)
        heads = choice.heads or (text.num_attention_heads if same_heads else max(1, hidden // head_dim))
        target_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        kv_heads = choice.kv_heads or math.gcd(heads, target_kv)
    if heads % kv_heads:
        raise ConfigError(f"train.drafter_kv_heads: {kv_heads} KV heads do not divide {heads} heads")
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}


def _mla_attention(text: Any, choice: DrafterChoice) -> dict[str, Any]:
    if _is_mla(text):
        v, nope, rope = int(text.v_head_dim), int(text.qk_nope_head_dim), int(text.qk_rope_head_dim)
        kv_lora = int(text.kv_lora_rank)
        q_lora = int(text.q_lora_rank or 3 * kv_lora)
    else:
        d = _target_head_dim(text)
        kv_lora = min(4 * d, max(16, text.hidden_size // 8))  # DeepSeek's 512 at 4096-7168 wide, less on small targets
        v, nope, rope, q_lora = d, d, d // 2, 3 * kv_lora
    if choice.head_dim and choice.head_dim != v:
        v = nope = choice.head_dim
    if rope % 2:
        raise ConfigError(f"train.drafter: MLA's rotary head dim {rope} must be even")
    heads = choice.heads or max(1, text.hidden_size // v)
    if choice.kv_heads and choice.kv_heads != heads:
        raise ConfigError("train.drafter_kv_heads: MLA shares one latent KV across all heads; leave it 0 with drafter = mla")
    # q_lora_rank always set: vLLM's drafter loads q_a_proj and kv_a_proj_with_mqa as one fused tensor
    return {"num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": rope, "q_lora_rank": q_lora,
            "kv_lora_rank": choice.kv_lora_rank or kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v}  # fmt: skip


def _engine_layer_fields(aux_layers: Sequence[int], target_architecture: str | None) -> dict[str, Any]:
    """The keys with which SGLang and vLLM name the captured layers: engine numbering, written
    at export only (a trained drafter's config keeps ``aux_layers`` in ours)."""
    vllm = engine_layer_ids(aux_layers, "vllm")
    # where SGLang cannot name these layers (serving_engines leaves it out), its key repeats vLLM's
    sglang = sglang_layer_ids(aux_layers, target_architecture) or vllm
    return {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": vllm,
    }


def _aux_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """Our aux layers: a trained drafter's config has them as they are; an exported one in vLLM's
    key (every engine's ids say the same where they can)."""
    if "aux_layers" in config:
        return tuple(int(layer) for layer in config["aux_layers"])
    return layers_from_engine_ids(config["eagle_aux_hidden_state_layer_ids"], "vllm")


def drafter_kind(config: dict[str, Any]) -> str:
    """The kind (``DRAFTERS``) a drafter's config dict describes: a trained drafter's says it
    (``drafter``); an exported one's (the engines' format, ours or another tool's) is read from
    the keys the engines read."""
    if config.get("drafter") in DRAFTERS:
        return str(config["drafter"])
    if is_dflash(config):
        return "dflash"
    attention = "mla" if config.get("kv_lora_rank") is not None else "eagle3"
    if config.get("fc_norm") and config.get("norm_output"):
        return "mla3.1" if attention == "mla" else "eagle3.1"
    return attention


def serving_engines(config: dict[str, Any]) -> tuple[str, ...]:
    """The engines whose loaders read this drafter as it was trained: every kind in both, but
    SGLang only where it can name the aux layers on this target (``sglang_unservable``)."""
    return tuple(engine for engine in SERVING_ENGINES if engine != "sglang" or not sglang_unservable(config))


def sglang_unservable(config: dict[str, Any]) -> str | None:
    """Why SGLang would capture other layers than the drafter was trained on; None if it would not."""
    if is_dflash(config):  # its target_layer_ids: every target's layer i's output, as vLLM's
        return None
    layers, architecture = _aux_layers(config), config.get("target_architecture")
    if sglang_layer_ids(layers, architecture) is not None:
        return None
    return (f"SGLang cannot capture layer {layers[0]}'s output on a {architecture} target (its set_eagle3_layers_to_capture "
            f"takes ids starting at 1 as one-based); serve this drafter with vLLM, or extract with aux layers from 1 up")  # fmt: skip


def geometry_mismatches(saved: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """The shape keys on which a saved drafter config and a freshly built one differ."""
    return [f"{key} {saved.get(key)!r} -> {built.get(key)!r}" for key in GEOMETRY_KEYS if saved.get(key) != built.get(key)]


def drafter_config_from_target(
    target_config: Any,
    *,
    draft_vocab_size: int,
    aux_layers: Sequence[int],
    vocab_size: int | None = None,
    choice: DrafterChoice | None = None,
    mask_token_id: int | None = None,
) -> Any:
    """A LlamaConfig for the drafter: one layer, the draft vocab, the attention ``choice`` asks
    for (the module docstring says how each size is chosen). ``vocab_size``: the target head's
    rows (``head_rows``), which prepare sized t2d by; the config's own ``vocab_size`` where not
    given. An MLA drafter's config carries MLA's keys beside Llama's (``head_dim`` is then the
    rotary width, as DeepSeek's configs have it). A dflash drafter's is a Qwen3Config
    (``dflash_config``) with Llama attention's sizes; ``mask_token_id``: its block's mask."""
    from transformers import LlamaConfig

    choice = choice or DrafterChoice()
    text = getattr(target_config, "text_config", None) or target_config
    attention = _mla_attention(text, choice) if choice.mla else _llama_attention(text, choice)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if choice.mla and not _is_mla(text):
        rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))}
    if rope:  # refused here, before a training whose drafter no engine would serve as trained
        engine_rope_scaling({k: v for k, v in rope.items() if k != "rope_theta"})
    architecture = (getattr(target_config, "architectures", None) or [None])[0]
    if choice.block:
        if mask_token_id is None:
            raise ValueError("a dflash drafter needs its mask token id")
        return dflash_config_from_target(
            text, attention, aux_layers=aux_layers, vocab_size=vocab_size if vocab_size is not None else text.vocab_size,
            layers=choice.layers, block_size=choice.block_size, mask_token_id=mask_token_id,
            intermediate_size=choice.intermediate_size or text.intermediate_size, rope=rope, target_architecture=architecture,
        )  # fmt: skip
    config = LlamaConfig(
        vocab_size=vocab_size if vocab_size is not None else text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=choice.intermediate_size or text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=attention.pop("num_attention_heads"),
        num_key_value_heads=attention.pop("num_key_value_heads"),
        head_dim=attention.pop("head_dim"),
        hidden_act=getattr(text, "hidden_act", "silu"),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
        tie_word_embeddings=False,
    )
    for key, value in attention.items():  # MLA's sizes
        setattr(config, key, value)
    if choice.eagle31:  # vLLM's names: a norm per aux layer before fc, the post-norm state carried on
        config.fc_norm, config.norm_output = True, True
    if rope:
        config.rope_parameters = dict(rope)
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = draft_vocab_size
    config.target_hidden_size = text.hidden_size
    config.target_architecture = architecture  # SGLang numbers the layers by it (modeling.layers)
    # the drafter spec, in our own terms until export: its kind, and the layers it reads in our numbering
    config.drafter, config.aux_layers = choice.kind, [int(layer) for layer in aux_layers]
    return config


def exported_config(drafter_config: dict[str, Any], capture: CaptureLayout, dtype: str) -> dict[str, Any]:
    """config.json as SGLang and vLLM read it, from the config the drafter was trained with and
    the layout of the features it was trained on. They want the flat pre-v5 rope fields (theta,
    and scaling only when not default), written so that each engine computes the rotary tables
    training did (``modeling.rope``; an InputError where none can)."""
    from transformers import LlamaConfig

    payload = LlamaConfig.from_dict(drafter_config).to_dict()
    payload["torch_dtype"] = dtype
    rope = dict(payload.get("rope_parameters") or {})
    payload["rope_theta"] = rope.get("rope_theta", payload.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    # both engines read rope_parameters first, so it carries the adjusted scaling too
    exported = engine_rope_scaling(scaling if scaling.get("rope_type", "default") != "default" else None)
    payload["rope_scaling"] = exported
    payload["rope_parameters"] = {**(exported or {"rope_type": "default"}), "rope_theta": payload["rope_theta"]}
    kind = drafter_kind(payload)
    if kind in BLOCK_DRAFTERS:
        return exported_dflash_config(drafter_config, capture.aux_layers, dtype, {key: payload[key] for key in _ROPE_FIELDS})
    payload.pop("aux_layers", None)  # one numbering in the file: the engines'
    payload.pop("drafter", None)
    payload.update(_engine_layer_fields(capture.aux_layers, drafter_config.get("target_architecture")))
    if kind.startswith("mla"):
        # vLLM builds it from a DeepseekV2Config: MLA attention, one dense MLP (never MoE)
        payload.update(architectures=[MLA_ARCHITECTURE], model_type=MLA_MODEL_TYPE)
    return payload


def exported_capture(config_file: Path) -> CaptureLayout:
    """The capture layout an exported drafter reads, from its config.json: both engines' keys
    must name the same layers."""
    try:
        payload = json.loads(config_file.read_text())
        if is_dflash(payload):
            return CaptureLayout(tuple(int(i) for i in payload["dflash_config"]["target_layer_ids"]), int(payload["target_hidden_size"]))
        sglang = layers_from_sglang_ids(payload["eagle_config"]["eagle_aux_hidden_state_layer_ids"], payload.get("target_architecture"))
        payload.setdefault("eagle_aux_hidden_state_layer_ids", engine_layer_ids(sglang, "vllm"))
        vllm, hidden_size = _aux_layers(payload), int(payload["target_hidden_size"])
        sglang_reads = "sglang" in serving_engines(payload)
    except FileNotFoundError:
        raise InputError(f"{config_file}: missing; run export first") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise InputError(f"{config_file}: not an EAGLE-3 drafter's config ({exc!r})") from None
    if sglang_reads and sglang != vllm:
        raise InputError(f"{config_file}: eagle_config names layers {list(sglang)} but eagle_aux_hidden_state_layer_ids {list(vllm)}")
    return CaptureLayout(vllm, hidden_size)


def drafting(config_file: Path, chain_tokens: int) -> tuple[str, int]:
    """(vLLM's speculative method, drafts per verify step) for the drafter exported at
    ``config_file``: an EAGLE-3 chain drafts ``chain_tokens`` (``[eval] draft_tokens``), a dflash
    drafter its whole block after the verified token (``block_size - 1``, what it trained for)."""
    payload = json.loads(config_file.read_text())
    if is_dflash(payload):
        return "dflash", int(payload["dflash_config"].get("block_size", payload.get("block_size", 16))) - 1
    return "eagle3", chain_tokens
