"""Extracted features, read lazily: a shard is memory-mapped (safetensors) when one of its
samples is first asked for, so training's step 1 does not wait for every file to be read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.training.artifacts import FeaturesIndex

__all__ = ["FeatureShards", "shard_name"]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


class FeatureShards:
    """Random access to extracted samples without loading every shard first: a shard is opened
    (memory-mapped by safetensors) when one of its samples is asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index = FeaturesIndex.read(directory)
        self.entries: list[tuple[str, int]] = []  # (shard file, position in shard) per sample
        for name, shard in self.index.ordered_shards():
            self.entries += [(name, j) for j in range(shard.samples)]
        self._open: dict[str, Any] = {}
        self._offsets: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.index.aux_layers)

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self._open:
            if len(self._open) > 8:
                self._open.pop(next(iter(self._open)))
            handle = safe_open(str(self.directory / name), framework="pt")
            self._open[name] = handle
            self._offsets[name] = handle.get_tensor("offsets").tolist()
        return self._open[name]

    def length(self, i: int) -> int:
        name, j = self.entries[i]
        self._handle(name)
        offsets = self._offsets[name]
        return offsets[j + 1] - offsets[j]

    def __getitem__(self, i: int) -> dict[str, Any]:
        name, j = self.entries[i]
        handle = self._handle(name)
        a, b = self._offsets[name][j], self._offsets[name][j + 1]
        return {key: handle.get_slice(key)[a:b] for key in ("input_ids", "loss_mask", "aux", "final")}
