"""The drafter's config, built in one place: the ``LlamaConfig`` we train with and the
``config.json`` SGLang and vLLM load from an export carry the same EAGLE-3 fields, written by
``_eagle3_fields`` alone; ``exported_capture`` reads them back.

SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids``; vLLM reads the top-level key
first. Each is in its engine's own numbering (``modeling.layers``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import InputError
from pipeline.training.artifacts import CaptureLayout
from pipeline.training.modeling.layers import engine_layer_ids, layers_from_engine_ids
from pipeline.training.modeling.rope import engine_rope_scaling

__all__ = ["ARCHITECTURE", "drafter_config_from_target", "exported_capture", "exported_config"]

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the class name both servers dispatch an EAGLE-3 drafter on


def _eagle3_fields(aux_layers: Sequence[int], *, draft_vocab_size: int, target_hidden_size: int) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_layers, "sglang"), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_layers, "vllm"),
    }


def drafter_config_from_target(
    target_config: Any, *, draft_vocab_size: int, aux_layers: Sequence[int], vocab_size: int | None = None
) -> Any:
    """A LlamaConfig for the drafter: the target's attention geometry, one layer, the draft vocab.
    ``vocab_size``: the target head's rows (``head_rows``), which prepare sized t2d by; the
    config's own ``vocab_size`` where not given."""
    from transformers import LlamaConfig

    text = getattr(target_config, "text_config", None) or target_config
    rope = getattr(text, "rope_parameters", None) or {}
    config = LlamaConfig(
        vocab_size=vocab_size if vocab_size is not None else text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", text.num_attention_heads),
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        hidden_act=getattr(text, "hidden_act", "silu"),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
        tie_word_embeddings=False,
    )
    if rope:
        config.rope_parameters = dict(rope)
        # refused here too, before a training whose drafter no engine would serve as trained
        engine_rope_scaling({k: v for k, v in rope.items() if k != "rope_theta"})
    for key, value in _eagle3_fields(aux_layers, draft_vocab_size=draft_vocab_size, target_hidden_size=text.hidden_size).items():
        setattr(config, key, value)
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
    payload.update(_eagle3_fields(capture.aux_layers, draft_vocab_size=payload["draft_vocab_size"], target_hidden_size=capture.hidden_size))
    return payload


def exported_capture(config_file: Path) -> CaptureLayout:
    """The capture layout an exported drafter reads, from its config.json: both engines' keys
    must name the same layers."""
    try:
        payload = json.loads(config_file.read_text())
        sglang = layers_from_engine_ids(payload["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "sglang")
        vllm = layers_from_engine_ids(payload.get("eagle_aux_hidden_state_layer_ids", engine_layer_ids(sglang, "vllm")), "vllm")
        hidden_size = int(payload["target_hidden_size"])
    except FileNotFoundError:
        raise InputError(f"{config_file}: missing; run export first") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{config_file}: not an EAGLE-3 drafter's config ({exc!r})") from None
    if sglang != vllm:
        raise InputError(f"{config_file}: eagle_config names layers {list(sglang)} but eagle_aux_hidden_state_layer_ids {list(vllm)}")
    return CaptureLayout(sglang, hidden_size)
