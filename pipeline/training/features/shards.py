"""The feature shard format, the one thing extract and train must read alike: a safetensors file
of ``shard_samples`` consecutive prepared samples concatenated (``input_ids`` int32,
``loss_mask`` uint8, ``offsets`` int64), with ``aux`` [T, 3H] and ``final`` [T, H] in bf16, or
as e4m3 codes with a float32 scale per token (and per layer) beside them (``*_scale``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.training.artifacts import FeatureShard, FeaturesIndex

__all__ = ["from_fp8", "shard_name", "to_fp8", "write_feature_shard"]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_feature_shard(
    out: Path, name: str, chunk: list[Any], offsets: list[int], aux: Any, final: Any, first: int, index: FeaturesIndex
) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {
        "input_ids": torch.cat([ids for ids, _ in chunk]).to(torch.int32),
        "loss_mask": torch.cat([mask for _, mask in chunk]).to(torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if index.storage == "fp8":
        layers = len(index.aux_layers)
        tensors["aux"], tensors["aux_scale"] = to_fp8(aux.reshape(aux.shape[0], layers, -1))
        tensors["final"], tensors["final_scale"] = to_fp8(final.unsqueeze(1))
    else:
        tensors["aux"], tensors["final"] = aux, final
    tmp = out / (name + ".tmp")
    # one metadata key: safetensors writes its metadata map in hash order, and a shard must come
    # out byte-identical when a killed extract redoes it
    save_file(
        tensors, str(tmp), metadata={"eagleops": json.dumps({"first_sample": first, "aux_layers": list(index.aux_layers)}, sort_keys=True)}
    )
    os.replace(tmp, out / name)
    index.shards[name] = FeatureShard(first, len(chunk), offsets[-1], (out / name).stat().st_size)
    index.write(out)


_E4M3_MAX = 448.0


def to_fp8(states: Any) -> tuple[Any, Any]:
    """[T, L, H] hidden states -> (e4m3 codes [T, L*H], float32 scales [T, L]): each token's
    vector in each layer scaled so its largest element lands on e4m3's largest (448)."""
    import torch

    scale = states.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / _E4M3_MAX
    codes = (states.float() / scale).to(torch.float8_e4m3fn)
    return codes.reshape(states.shape[0], -1).contiguous(), scale.squeeze(-1).contiguous()


def from_fp8(codes: Any, scale: Any, dtype: Any) -> Any:
    """The inverse of ``to_fp8``: [T, L*H] codes and [T, L] scales -> [T, L*H] in ``dtype``."""
    layers = scale.shape[-1]
    states = codes.float().reshape(codes.shape[0], layers, -1) * scale.float().unsqueeze(-1)
    return states.reshape(codes.shape[0], -1).to(dtype)
