"""Which of the target's layers the drafter reads, and how each engine numbers them.

Our number for a captured layer is L, the 0-based decoder layer whose *output* (the residual
stream after it) is captured; the features index, the checkpoint and the vLLM capture hook all
use it. Every other engine counts differently, and this module is the only place that knows how:

- ``hf``: ``output_hidden_states`` puts the embeddings first, so layer L's output is
  ``hidden_states[L + 1]``.
- ``sglang``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` takes L and SGLang adds the 1
  itself when it captures, except on its DeepSeek-family targets (``SGLANG_VERBATIM_TARGETS``):
  these add the 1 only to a list that starts at 1 and take any other list as vLLM does, as the
  layer whose input is captured. There, a list starting at 0 cannot be said at all (``None``).
- ``vllm``: the top-level ``eagle_aux_hidden_state_layer_ids`` (read before ``eagle_config``, and
  the speculators format's key) names the layer whose *input* is captured: L + 1.

Torch-free: the config and the index readers use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from eagleops.pipeline.config import BLOCK_DRAFTERS, TrainConfig
from eagleops.pipeline.errors import InputError

__all__ = [
    "SGLANG_VERBATIM_TARGETS",
    "Engine",
    "default_aux_layers",
    "dflash_aux_layers",
    "drafter_layer_count",
    "engine_layer_ids",
    "layers_from_engine_ids",
    "layers_from_sglang_ids",
    "sglang_layer_ids",
]

Engine = Literal["hf", "sglang", "vllm"]

# what each engine adds to our L to name the same captured state
_OFFSET: dict[str, int] = {"hf": 1, "sglang": 0, "vllm": 1}
# Targets whose SGLang set_eagle3_layers_to_capture adds the 1 only when the ids start at 1
# (SGLang 0.5.23 deepseek_v2.py:3458-3473, glm4_moe_lite.py:805-820; Kimi-K2.5's language model
# is DeepseekV3ForCausalLM, kimi_k25.py:693), keyed by the target's architectures[0]
SGLANG_VERBATIM_TARGETS = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Glm4MoeLiteForCausalLM",
    }
)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Outputs of layers [1, N//2 - 1, N - 4] (0-based), as EAGLE-3 and SpecForge pick them."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if min(layers) < 0 or len(set(layers)) < 3:
        # tiny targets: spread three distinct layers as evenly as the depth allows
        spread = sorted({max(0, min(num_layers - 1, round(x))) for x in (num_layers * 0.15, num_layers * 0.5, num_layers * 0.85)})
        if len(spread) < 3:
            raise InputError(f"a target with {num_layers} layers is too shallow for three auxiliary layers")
        layers = (spread[0], spread[1], spread[2])
    return layers


DFLASH_LAYERS = 5  # z-lab's and SpecForge's published DFlash drafters (Qwen3-4B/8B, gpt-oss) have five


def drafter_layer_count(train: TrainConfig) -> int:
    """The drafter's decoder layers: ``train.drafter_layers``, else one (EAGLE-3) or DFlash's five."""
    if train.drafter_layers:
        return train.drafter_layers
    return DFLASH_LAYERS if train.drafter in BLOCK_DRAFTERS else 1


def dflash_aux_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """One layer per dflash drafter layer, spread evenly over outputs 1..N-3 (the middle one for
    a single layer), as z-lab's DFlash, SpecForge and SGLang's ``build_target_layer_ids`` pick
    them (Qwen3-8B, 36 layers, 5: [1, 9, 17, 25, 33])."""
    if count == 1:
        return (num_layers // 2,)
    start, end = 1, num_layers - 3
    layers = tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))
    if len(set(layers)) < count or min(layers) < 0 or max(layers) >= num_layers:
        raise InputError(f"a target with {num_layers} layers is too shallow for {count} distinct dflash layers: set extract.aux_layers")
    return layers


def engine_layer_ids(aux_layers: Sequence[int], engine: Engine) -> list[int]:
    """Our aux layers as ``engine`` numbers them (see the module's docstring)."""
    return [layer + _OFFSET[engine] for layer in aux_layers]


def layers_from_engine_ids(ids: Sequence[int], engine: Engine) -> tuple[int, ...]:
    """The inverse of ``engine_layer_ids``: ``engine``'s ids back to ours."""
    return tuple(int(i) - _OFFSET[engine] for i in ids)


def sglang_layer_ids(aux_layers: Sequence[int], target_architecture: str | None) -> list[int] | None:
    """The ``eagle_config`` ids with which SGLang, serving ``target_architecture``, captures our
    ``aux_layers``; None where it cannot (a DeepSeek-family target and a list starting at layer 0:
    its ids would start at 1, which SGLang takes as one-based)."""
    if target_architecture not in SGLANG_VERBATIM_TARGETS or (aux_layers and aux_layers[0] == 1):
        return engine_layer_ids(aux_layers, "sglang")
    if aux_layers and aux_layers[0] == 0:
        return None
    return engine_layer_ids(aux_layers, "vllm")  # taken verbatim: the layer whose input is captured


def layers_from_sglang_ids(ids: Sequence[int], target_architecture: str | None) -> tuple[int, ...]:
    """The inverse of ``sglang_layer_ids``."""
    if target_architecture not in SGLANG_VERBATIM_TARGETS or (ids and int(ids[0]) == 1):
        return layers_from_engine_ids(ids, "sglang")
    return layers_from_engine_ids(ids, "vllm")
