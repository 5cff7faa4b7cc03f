"""The drafter's rotary tables in training and in each serving engine, and the export's
rope_scaling that makes them the same.

A rotary table is ``cos(p * inv_freq) * A`` and ``sin(p * inv_freq) * A``: ``A`` (YaRN's
"attention factor", vLLM's and SGLang's ``mscale``) multiplies every query and key, so an engine
whose ``A`` differs from training's scales every attention logit by ``A_engine**2 / A_trained**2``
(for DeepSeek-V3.1, 1.87x). What each reads, for ``rope_type: yarn`` (the drafter is a Llama, so
all three use their plain YaRN class; the softmax scale is ``head_dim**-0.5`` in all three:
transformers ``models/llama/modeling_llama.py``, vLLM ``models/llama.py:162``, SGLang
``models/llama.py:203``):

* transformers 5.25 (training, ``modeling_rope_utils.py:441-457``): ``attention_factor`` if set;
  else, when ``mscale`` and ``mscale_all_dim`` are both truthy,
  ``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim)``; else ``yarn_get_mscale(f)``
  (``0.1 ln f + 1``, ``:346-350``). ``beta_fast or 32``, ``beta_slow or 1`` (``:461-462``),
  ``truncate`` default True (``:492``).
* vLLM 0.32.0: the EAGLE-3 drafter's layer is ``models/llama.py``'s ``LlamaDecoderLayer``
  (``models/llama_eagle3.py:67-76``) on the draft config (``config/speculative.py:1402-1420``
  wraps it in ``EAGLEConfig``, which copies ``rope_parameters``; ``transformers_utils/config.py:
  622-641`` standardises ``rope_scaling`` into it); ``LlamaAttention._init_rotary_emb``
  (``models/llama.py:236-247``) calls ``get_rope(rope_parameters=...)``, whose yarn branch
  (``layers/rotary_embedding/__init__.py:243-283``) passes ``beta_fast``, ``beta_slow``,
  ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate`` to
  ``YaRNScalingRotaryEmbedding``; its rule (``yarn_scaling_rope.py:38-46``) is transformers'.
* SGLang 0.5.23: ``models/llama.py:322-328`` reads ``rope_parameters`` (else ``rope_scaling``);
  ``layers/rotary_embedding/factory.py:311-332`` passes ``attn_factor``, ``beta_fast``,
  ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate`` but not ``attention_factor``;
  ``yarn.py:122-131``: the ratio when ``mscale`` and ``mscale_all_dim`` are both *not None*, else
  ``yarn_get_mscale(f)``, times ``attn_factor`` (default 1).

The frequencies are one formula in all three (same ramp, ``original_max_position_embeddings``,
``truncate``); only transformers' ``or`` defaults for the betas differ, so the export writes the
betas it trained with. For the zoo's yarn targets all three give: DeepSeek-V3.1 (f 40, mscale =
mscale_all_dim = 1) A = 1.0; Kimi-K2.5 (f 64, same) A = 1.0; gpt-oss-20b (f 32, no mscale keys)
A = 1.3466. Releases that drop the mscale keys (vLLM 0.25, vllm-project/vllm#48621; SGLang before
sgl-project/sglang#22711) serve ``yarn_get_mscale(f)``: 1.3689 and 1.4159 for the first two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from eagleops.pipeline.errors import InputError

__all__ = [
    "ENGINES",
    "attention_factor",
    "engine_rope_mismatches",
    "engine_rope_scaling",
    "legacy_engine_warning",
    "rope_table",
    "yarn_inv_freq",
]

TOLERANCE = 1e-9  # relative: an adjusted mscale reproduces the factor to float rounding


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21, as all three engines write it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mscale_ratio(scaling: dict[str, Any]) -> float:
    factor = float(scaling["factor"])
    return _yarn_mscale(factor, float(scaling["mscale"])) / _yarn_mscale(factor, float(scaling["mscale_all_dim"]))


def _transformers(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return _mscale_ratio(scaling)
    return _yarn_mscale(float(scaling["factor"]))


def _sglang(scaling: dict[str, Any]) -> float:
    both = scaling.get("mscale") is not None and scaling.get("mscale_all_dim") is not None
    base = _mscale_ratio(scaling) if both else _yarn_mscale(float(scaling["factor"]))
    return base * float(scaling.get("attn_factor", 1.0))


def _legacy(scaling: dict[str, Any]) -> float:
    return _yarn_mscale(float(scaling["factor"])) * float(scaling.get("attn_factor", 1.0))


# training's rule, then each engine we serve with; vLLM 0.32 reads the keys as transformers does
_RULES: dict[str, Callable[[dict[str, Any]], float]] = {"transformers": _transformers, "vllm": _transformers, "sglang": _sglang}
ENGINES = ("vllm", "sglang")
LEGACY = "vLLM 0.25 (vllm-project/vllm#48621) and SGLang before sgl-project/sglang#22711"


def _is_yarn(scaling: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return scaling is not None and (scaling.get("rope_type") or scaling.get("type")) == "yarn"


def attention_factor(engine: str, scaling: dict[str, Any] | None) -> float:
    """The factor ``engine`` ("transformers", "vllm", "sglang") multiplies its cos/sin by, from a
    flat rope_scaling; 1.0 for every type but yarn, which none of them scales."""
    return _RULES[engine](scaling) if _is_yarn(scaling) else 1.0


def yarn_inv_freq(scaling: dict[str, Any], theta: float, dim: int) -> Any:
    """YaRN's inverse frequencies, the one formula of all three engines (``_compute_yarn_parameters``,
    vLLM's and SGLang's ``YaRNScalingRotaryEmbedding._compute_inv_freq``)."""
    import torch

    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    extrapolate = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_table(engine: str, scaling: dict[str, Any], theta: float, dim: int, positions: Any) -> tuple[Any, Any]:
    """cos and sin ``[len(positions), dim]`` (halves repeated, as transformers' Llama lays them
    out) that ``engine`` computes for a yarn rope_scaling."""
    import torch

    freqs = torch.outer(positions.to(torch.float32), yarn_inv_freq(scaling, theta, dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = attention_factor(engine, scaling)
    return emb.cos() * factor, emb.sin() * factor


def _adjusted(scaling: dict[str, Any]) -> dict[str, Any]:
    """The same tables in every engine's reading, where exact: the betas as trained; keys only
    SGLang reads dropped (``attn_factor``; mscale keys transformers ignores because one is falsy);
    an ``attention_factor``, which SGLang ignores, restated as the mscale pair that yields it."""
    out = {key: value for key, value in scaling.items() if key != "attn_factor"}
    out["beta_fast"], out["beta_slow"] = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    if not (out.get("mscale") and out.get("mscale_all_dim")):
        out.pop("mscale", None)
        out.pop("mscale_all_dim", None)
    trained = _transformers(scaling)
    log_factor = math.log(float(out["factor"])) if float(out["factor"]) > 1 else 0.0
    if out.get("attention_factor") is not None and log_factor and not _close(_sglang(out), trained):
        # (1 + 0.1 m ln f) / (1 + 0.1 ln f) = trained  =>  m = (trained (1 + 0.1 ln f) - 1) / (0.1 ln f)
        out["mscale_all_dim"] = 1.0
        out["mscale"] = (trained * (1 + 0.1 * log_factor) - 1) / (0.1 * log_factor)
    return out


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE)


def engine_rope_mismatches(scaling: dict[str, Any] | None, trained: dict[str, Any] | None = None) -> list[str]:
    """One message per engine whose cos/sin for ``scaling`` (what the export writes) differ from
    those of ``trained`` (what the drafter was trained with; ``scaling`` itself if not given)."""
    trained = scaling if trained is None else trained
    if not _is_yarn(trained):
        return []
    expected = attention_factor("transformers", trained)
    messages = []
    for engine in ENGINES:
        served = attention_factor(engine, scaling)
        if not _close(served, expected):
            messages.append(
                f"{engine} would scale the drafter's rotary cos/sin by {served:.6g} where training used {expected:.6g} "
                f"(rope_scaling {scaling})"
            )
    return messages


def engine_rope_scaling(trained: dict[str, Any] | None) -> dict[str, Any] | None:
    """The rope_scaling to export for a drafter trained with ``trained``: adjusted so that vLLM
    and SGLang compute training's tables, or an InputError naming the engine, both factors and
    the remedy where no rope_scaling can."""
    if not _is_yarn(trained):
        return trained
    exported = _adjusted(trained)
    mismatches = engine_rope_mismatches(exported, trained)
    if mismatches:
        raise InputError(
            "the drafter's rotary tables cannot be the same in training and in every engine: "
            + "; ".join(mismatches)
            + ". Remedy: give the target's yarn rope_scaling as factor > 1 with mscale/mscale_all_dim "
            "(not attention_factor), which every engine reads alike, and train again"
        )
    return exported


def legacy_engine_warning(exported: dict[str, Any] | None) -> str | None:
    """A note for the releases that drop the mscale keys, where the tables rely on them."""
    if not _is_yarn(exported):
        return None
    expected, served = attention_factor("transformers", exported), _legacy(exported)
    if _close(served, expected):
        return None
    return (
        f"the drafter's rotary cos/sin scale is {expected:.6g}; {LEGACY} ignore mscale/mscale_all_dim and "
        f"would serve {served:.6g}: serve it with vLLM >= 0.32 or SGLang >= 0.5.23"
    )
