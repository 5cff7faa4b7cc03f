"""Which of the target's layers the drafter reads, and how each engine numbers them.

Our number for a captured layer is L, the 0-based decoder layer whose *output* (the residual
stream after it) is captured; the features index, the checkpoint and the vLLM capture hook all
use it. Every other engine counts differently, and this module is the only place that knows how:

- ``hf``: ``output_hidden_states`` puts the embeddings first, so layer L's output is
  ``hidden_states[L + 1]``.
- ``sglang``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` takes L and SGLang adds the 1
  itself when it captures.
- ``vllm``: the top-level ``eagle_aux_hidden_state_layer_ids`` (read before ``eagle_config``, and
  the speculators format's key) names the layer whose *input* is captured: L + 1.

Torch-free: the config and the index readers use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeline.errors import InputError

__all__ = ["Engine", "default_aux_layers", "engine_layer_ids", "layers_from_engine_ids"]

Engine = Literal["hf", "sglang", "vllm"]

# what each engine adds to our L to name the same captured state
_OFFSET: dict[str, int] = {"hf": 1, "sglang": 0, "vllm": 1}


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


def engine_layer_ids(aux_layers: Sequence[int], engine: Engine) -> list[int]:
    """Our aux layers as ``engine`` numbers them (see the module's docstring)."""
    return [layer + _OFFSET[engine] for layer in aux_layers]


def layers_from_engine_ids(ids: Sequence[int], engine: Engine) -> tuple[int, ...]:
    """The inverse of ``engine_layer_ids``: ``engine``'s ids back to ours."""
    return tuple(int(i) - _OFFSET[engine] for i in ids)
