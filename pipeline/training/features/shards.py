"""The feature shard format, the one thing extract and train must read alike: a safetensors file
of ``shard_samples`` consecutive prepared samples concatenated (``input_ids`` int32,
``loss_mask`` uint8, ``offsets`` int64), with ``aux`` [T, 3H] and ``final`` [T, H] in bf16, or
as one-byte codes (int8 or e4m3) with a float32 scale per token and layer and, for int8, each
vector's largest values kept apart (``*_scale``, ``*_kept_*``): ``CODECS`` holds each
storage's encoding."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagleops.pipeline.training.artifacts import FeatureShard, FeaturesIndex

__all__ = ["CODECS", "Codec", "HEADER_BYTES", "shard_bytes_bound", "shard_name", "write_feature_shard"]

# a safetensors header: 8 bytes of length, then JSON naming at most 11 tensors (about 90 bytes
# each) and our metadata; 4 KiB holds it with room to spare
HEADER_BYTES = 4096


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def shard_bytes_bound(index: FeaturesIndex, tokens: int, samples: int) -> int:
    """At least the bytes ``write_feature_shard`` writes for ``samples`` samples of ``tokens``
    tokens in all: a bounded cache makes room for this before extract computes the shard (the
    largest shard so far is no bound: the next may hold longer samples)."""
    codec = CODECS[index.storage]
    per_token = 4 + 1 + codec.bytes(index.hidden_size, len(index.aux_layers)) + codec.bytes(index.hidden_size, 1)
    return tokens * per_token + 8 * (samples + 1) + HEADER_BYTES


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
    for key, states, layers in (("aux", aux, len(index.aux_layers)), ("final", final, 1)):
        for suffix, tensor in CODECS[index.storage].encode(states.reshape(states.shape[0], layers, -1)).items():
            tensors[key + suffix] = tensor
    tmp = out / (name + ".tmp")
    # one metadata key: safetensors writes its metadata map in hash order, and a shard must come
    # out byte-identical when a killed extract redoes it
    save_file(
        tensors, str(tmp), metadata={"eagleops": json.dumps({"first_sample": first, "aux_layers": list(index.aux_layers)}, sort_keys=True)}
    )
    os.replace(tmp, out / name)
    index.shards[name] = FeatureShard(first, len(chunk), offsets[-1], (out / name).stat().st_size)
    index.write(out)


class Codec:
    """How one stored part ([T, L, H] hidden states) becomes tensors in a shard and back.

    ``encode`` gives {suffix: tensor}, every tensor T rows first, stored as ``{key}{suffix}``
    (``aux``, ``aux_scale``, ...); ``decode`` takes the same dict (sliced to a sample's rows) and
    hands train the states as ``dtype`` [T, L*H]. This one is bf16, stored as is."""

    name = "bf16"
    suffixes: tuple[str, ...] = ("",)

    def bytes(self, hidden: int, layers: int) -> int:
        """Stored bytes per token for ``layers`` states ``hidden`` wide."""
        return 2 * layers * hidden

    def encode(self, states: Any) -> dict[str, Any]:
        return {"": states.reshape(states.shape[0], -1).contiguous()}

    def decode(self, parts: dict[str, Any], dtype: Any) -> Any:
        return parts[""].to(dtype)


class Fp8(Codec):
    """e4m3, each token's vector in each layer scaled so its largest magnitude lands on 448.
    The exponent keeps outliers and small values alike, but 3 mantissa bits cost about 3% on
    every value."""

    name = "fp8"
    suffixes = ("", "_scale")

    def bytes(self, hidden: int, layers: int) -> int:
        return layers * (hidden + 4)

    def encode(self, states: Any) -> dict[str, Any]:
        import torch

        wide = states.float()
        scale = wide.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        codes = (wide / scale).to(torch.float8_e4m3fn)
        return {"": codes.reshape(states.shape[0], -1).contiguous(), "_scale": scale.squeeze(-1).contiguous()}

    def decode(self, parts: dict[str, Any], dtype: Any) -> Any:
        codes, scale = parts[""], parts["_scale"]
        states = codes.float().reshape(codes.shape[0], scale.shape[-1], -1) * scale.float().unsqueeze(-1)
        return states.reshape(codes.shape[0], -1).to(dtype)


class Int8(Codec):
    """Symmetric int8 rounded to nearest, each token's vector in each layer on its own scale,
    with its ``keep`` largest-magnitude values stored apart, exactly (bf16, and their int16
    channel). Large models' residual streams carry a few channels tens to thousands of times
    the rest (outlier features, massive activations); kept apart, they no longer set the step
    of every other value, which is then 1/127 of the rest's largest: about 4x finer than e4m3's
    on the demo, and on a synthetic stream with such outliers (bench/feature_storage.py)."""

    name = "int8"

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.suffixes = ("", "_scale", "_kept_channel", "_kept_value") if keep else ("", "_scale")

    def kept(self, hidden: int) -> int:
        """Values kept apart per vector: ``keep``, but one per 64 values in narrow ones."""
        return max(1, min(self.keep, hidden // 64)) if self.keep else 0

    def bytes(self, hidden: int, layers: int) -> int:
        return layers * (hidden + 4 + 4 * self.kept(hidden))

    def encode(self, states: Any) -> dict[str, Any]:
        import torch

        t = states.shape[0]
        wide = states.float()
        parts = {}
        if self.keep:
            channel = wide.abs().topk(self.kept(wide.shape[-1]), dim=-1).indices
            parts["_kept_channel"] = channel.to(torch.int16).reshape(t, -1).contiguous()
            parts["_kept_value"] = states.gather(-1, channel).to(torch.bfloat16).reshape(t, -1).contiguous()
            wide = wide.scatter(-1, channel, 0.0)
        scale = wide.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
        codes = (wide / scale).round().clamp(-127, 127).to(torch.int8)
        return {"": codes.reshape(t, -1).contiguous(), "_scale": scale.squeeze(-1).contiguous(), **parts}

    def decode(self, parts: dict[str, Any], dtype: Any) -> Any:
        codes, scale = parts[""], parts["_scale"]
        t, layers = codes.shape[0], scale.shape[-1]
        states = codes.float().reshape(t, layers, -1) * scale.float().unsqueeze(-1)
        if "_kept_channel" in parts:
            channel = parts["_kept_channel"].long().reshape(t, layers, -1)
            states = states.scatter(-1, channel, parts["_kept_value"].float().reshape(t, layers, -1))
        return states.reshape(t, -1).to(dtype)


CODECS: dict[str, Codec] = {codec.name: codec for codec in (Codec(), Fp8(), Int8())}
