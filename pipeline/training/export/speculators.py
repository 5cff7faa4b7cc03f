"""The export in vllm-project/speculators' format (``drafter-speculators/`` beside the SGLang/vLLM
one): ``speculators_config`` naming the target as verifier, the mid layer as ``layers.0.*``.
``vllm serve DRAFTER_DIR`` recognises it as a speculator on its own."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.training.artifacts import CaptureLayout
from eagleops.pipeline.training.modeling.layers import engine_layer_ids

__all__ = ["speculators_config", "speculators_dir", "speculators_weights"]


def speculators_dir(config: RunConfig) -> Path:
    return config.layout.speculators


def speculators_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The exported tensors under speculators' names: the mid layer is its ``layers.0``."""
    return {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v for k, v in weights.items()}


def speculators_config(
    server: dict[str, Any], capture: CaptureLayout, verifier: Path, architectures: Sequence[str], draft_tokens: int
) -> dict[str, Any]:
    """vllm-project/speculators' Eagle3 config: what ``vllm serve DRAFTER_DIR`` auto-detects. The
    verifier is named by its own architectures (its config.json's), which vLLM checks the
    target against; the drafter's layer is a Llama layer whatever the target."""
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
        # EAGLE-3.1's norms (vLLM reads both keys here and in the plain export alike)
        "fc_norm": bool(server.get("fc_norm", False)),
        "norm_output": bool(server.get("norm_output", False)),
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(capture.aux_layers, "vllm"),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(architectures)},
        },
    }
