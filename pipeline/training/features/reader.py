"""Extracted features, read lazily: a shard is memory-mapped (safetensors) when one of its
samples is first asked for, so training's step 1 does not wait for every file to be read."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.training.artifacts import INDEX, CaptureLayout, FeaturesIndex
from eagleops.pipeline.training.features.cache import ConsumedShards
from eagleops.pipeline.training.features.layout import FeatureSet
from eagleops.pipeline.training.features.shards import CODECS, shard_name

__all__ = ["FeatureShards"]


class FeatureShards:
    """Random access to extracted samples without loading every shard first: a shard is opened
    (memory-mapped by safetensors) when one of its samples is asked for.

    Following an extract that is still writing (``follow``: the stage context), ``layout`` is the
    feature set that extract makes: the index it writes first, once it names that set, says how
    many samples there will be, and a sample whose shard is not written yet waits for it."""

    def __init__(self, directory: Path, *, follow: Any = None, layout: FeatureSet | None = None):
        self.directory = directory
        self.follow = follow
        self.waiting_for: str | None = None  # the shard a following read waits on, if any
        self._logged_wait = -1e9
        self.index = self._following_index(layout) if follow is not None else FeaturesIndex.read(directory)
        self.entries: list[tuple[str, int]] = []  # (shard file, position in shard) per sample
        if follow is None:
            for name, shard in self.index.ordered_shards():
                self.entries += [(name, j) for j in range(shard.samples)]
        self._open: dict[str, Any] = {}
        self._offsets: dict[str, list[int]] = {}

    def _following_index(self, layout: FeatureSet | None) -> FeaturesIndex:
        """The index of the features this run file makes, once extract has written it."""
        while True:
            index = FeaturesIndex.read_if_present(self.directory)
            if index is not None and FeatureSet.of(index) == layout and index.samples is not None:
                self.waiting_for = None
                return index
            self._wait(INDEX)

    def _reread(self) -> None:
        index = FeaturesIndex.read_if_present(self.directory)
        if index is None:
            return
        if FeatureSet.of(index) != FeatureSet.of(self.index):
            raise RunError(f"{self.directory}: extract started over with other features under this train; train again")
        self.index = index

    def _wait(self, what: str) -> None:
        if self.waiting_for is None and time.monotonic() - self._logged_wait > 60:  # not a line per shard
            self.follow.log("info", f"{self.follow.stage}: waiting for extract to write {what}")
            self._logged_wait = time.monotonic()
        self.waiting_for = what
        self.follow.checkpoint()
        time.sleep(0.25)

    def __len__(self) -> int:
        return self.index.samples if self.follow is not None and self.index.samples is not None else len(self.entries)

    @property
    def per_shard(self) -> int:
        return self.index.shard_samples or max(1, len(self.entries))

    def _locate(self, i: int) -> tuple[str, int]:
        if self.follow is None:
            return self.entries[i]
        k, j = divmod(i, self.per_shard)
        name = shard_name(k)
        while name not in self.index.shards or not (self.directory / name).exists():
            if name in self.index.shards and name in ConsumedShards.read(self.directory, self.index.prepared).shards:
                raise RunError(
                    f"{self.directory / name}: deleted after a train checkpointed past it (extract.max_cache_gb); "
                    f"to train again from the start, delete {self.directory / 'consumed.json'} and extract again"
                )
            if self.index.complete and name not in self.index.shards:
                raise RunError(f"{self.directory}: {name} is not in the index though extract has finished")
            self._wait(name)  # not listed yet, or listed and not visible yet (shared storage lags)
            self._reread()
        self.waiting_for = None
        return name, j

    def wait_for(self, i: int) -> None:
        """Block until sample ``i`` can be read (following extract)."""
        if self.follow is not None:
            self._locate(i)

    @property
    def capture(self) -> CaptureLayout:
        return self.index.capture

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self._open:
            # following, reads go shard by shard: holding only the newest two lets a deleted
            # shard's disk space go (an open map keeps an unlinked file's blocks)
            if len(self._open) > (1 if self.follow is not None else 8):
                dropped = next(iter(self._open))
                self._open.pop(dropped)
                self._offsets.pop(dropped, None)
            handle = safe_open(str(self.directory / name), framework="pt")
            self._open[name] = handle
            self._offsets[name] = handle.get_tensor("offsets").tolist()
        return self._open[name]

    def length(self, i: int) -> int:
        name, j = self._locate(i)
        self._handle(name)
        offsets = self._offsets[name]
        return offsets[j + 1] - offsets[j]

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        name, j = self._locate(i)
        handle = self._handle(name)
        a, b = self._offsets[name][j], self._offsets[name][j + 1]
        sample = {key: handle.get_slice(key)[a:b] for key in ("input_ids", "loss_mask", "aux", "final")}
        if self.index.storage != "bf16":  # back to bf16, as a bf16 shard reads
            codec = CODECS[self.index.storage]
            for key in ("aux", "final"):
                sample[key] = codec.decode({suffix: handle.get_slice(key + suffix)[a:b] for suffix in codec.suffixes}, torch.bfloat16)
        return sample
