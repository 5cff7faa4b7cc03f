"""The rows that came with generate (``[extract] during_generate``): the hidden states the serving
target kept of every reply as it wrote it, in ``OUT/<dataset>/captured/`` (``generate.capture``).

A sample takes them by its token ids, not by bookkeeping: a row's state is a function of the ids
up to it, so any captured sequence that begins with the sample's ids holds the sample's states,
whatever prepare made of the record (a reply cut at ``max_length``, two replies of a chat in one
sample, a record dropped). A capture keeps the sequence the server processed but its last id,
which was generated and never fed back, so it has no state; the last row of a sample that ends
where its reply ended is therefore zero. Training never reads it: a position's loss is against
the next position's target and the drafter attends only backwards (``train.loss``), so the last
row neither is a target nor reaches one (``tests/unit/test_one_pass.py`` checks the loss is the
same). A sample no capture begins with (another endpoint's record, a prompt rendered again) is
computed by extract's backend as before.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig

__all__ = ["GeneratedRows", "log_generated", "sample_key", "shard_from_generate"]

FINAL, TOKENS, OFFSETS = "final", "input_ids", "offsets"  # the names the capture extension writes


def sample_key(ids: Any) -> str:
    """The digest of a row run's token ids (int32): how a sample finds the capture that holds it."""
    import numpy as np

    return hashlib.blake2b(np.ascontiguousarray(np.asarray(ids, dtype=np.int32)).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class _Capture:
    chunk: str  # the chunk's stem
    start: int  # its first row in the chunk
    rows: int


class GeneratedRows:
    """Every capture of the run's datasets, found by the ids a sample begins with."""

    def __init__(self, layers: tuple[int, ...], files: dict[str, dict[str, Path]], found: dict[tuple[int, str], _Capture]):
        self.layers = layers
        self._files = files  # chunk stem -> tensor name -> the rank file that holds it
        self._found = found  # (length, digest of the first `length` ids) -> the capture
        self.rows_used = 0
        self.samples_used = 0
        self._open: dict[Path, Any] = {}  # each chunk file opened once (its header parsed once), not per sample

    def _file(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    @classmethod
    def find(cls, config: RunConfig, layers: tuple[int, ...]) -> GeneratedRows | None:
        """The run's captures that hold all of ``layers`` and the final state; None if none do."""
        from safetensors import safe_open

        wanted = {*map(str, layers), FINAL, TOKENS, OFFSETS}
        files: dict[str, dict[str, Path]] = defaultdict(dict)
        for ds in config.datasets:
            for _, path in config.layout.dataset(ds.name).capture_chunks():
                if path.name.endswith(".safetensors"):
                    with safe_open(str(path), framework="pt") as f:
                        for name in f.keys():
                            files[f"{ds.name}/{path.name.split('.')[0]}"].setdefault(name, path)
        found: dict[tuple[int, str], _Capture] = {}
        for chunk, names in files.items():
            if not wanted <= set(names):
                continue
            with safe_open(str(names[TOKENS]), framework="pt") as f:
                ids, offsets = f.get_tensor(TOKENS).numpy(), f.get_tensor(OFFSETS).tolist()
            for start, end in zip(offsets, offsets[1:], strict=False):
                capture = _Capture(chunk, start, end - start)
                # a sample of length m needs the states of its first m - 1 ids (its last row is
                # not trained): the whole capture, or its first max_length - 1 ids for a cut sample
                for length in {end - start, min(end - start, config.prepare.max_length - 1)}:
                    found.setdefault((length, sample_key(ids[start : start + length])), capture)
        usable = {chunk: names for chunk, names in files.items() if wanted <= set(names)}
        return cls(layers, usable, found) if found else None

    def holds(self, ids: Any) -> bool:
        return self._lookup(ids) is not None

    def _lookup(self, ids: Any) -> _Capture | None:
        n = len(ids) - 1
        return self._found.get((n, sample_key(ids[:n]))) if n > 0 else None

    def features(self, ids: Any) -> tuple[Any, Any] | None:
        """(aux [m, 3H], final [m, H]) bf16 of a sample of ``m`` ids, or None if no capture holds it."""
        import torch

        capture = self._lookup(ids)
        if capture is None:
            return None
        m = len(ids)
        names = self._files[capture.chunk]
        rows = min(m, capture.rows)
        captured_ids = self._file(names[TOKENS]).get_slice(TOKENS)[capture.start : capture.start + rows]
        if not torch.equal(captured_ids[: m - 1].long(), torch.as_tensor(ids[: m - 1]).long()):
            return None  # another sequence with the same digest: computed instead
        if rows == m and int(captured_ids[m - 1]) != int(ids[m - 1]):
            rows = m - 1  # the capture goes on with another id: its row is not this sample's
        parts = []
        for name in [*map(str, self.layers), FINAL]:
            part = self._file(names[name]).get_slice(name)[capture.start : capture.start + rows].to(torch.bfloat16)
            if rows < m:  # the last row: no state was computed for it (see the module's doc)
                part = torch.cat([part, part.new_zeros((m - rows, part.shape[1]))])
            parts.append(part)
        self.rows_used += m
        self.samples_used += 1
        return torch.cat(parts[:-1], dim=-1), parts[-1]


def shard_from_generate(generated: GeneratedRows | None, chunk: list[Any], compute: Any) -> tuple[list[int], Any, Any, int]:
    """(offsets, aux, final, rows that came with generate) of one shard: each sample's rows from
    generate where a capture holds them, the others from ``compute(samples) -> (offsets, aux,
    final)``, the extract backend's own."""
    import torch

    offsets = [0]
    for ids, _ in chunk:
        offsets.append(offsets[-1] + len(ids))
    found = [generated.features(ids) if generated is not None else None for ids, _ in chunk]
    missing = [i for i, f in enumerate(found) if f is None]
    if len(missing) == len(chunk):
        return (*compute(chunk), 0)
    first = next(f for f in found if f is not None)
    aux = torch.empty((offsets[-1], first[0].shape[1]), dtype=torch.bfloat16)
    final = torch.empty((offsets[-1], first[1].shape[1]), dtype=torch.bfloat16)
    if missing:
        sub_offsets, sub_aux, sub_final = compute([chunk[i] for i in missing])
        for k, i in enumerate(missing):
            aux[offsets[i] : offsets[i + 1]] = sub_aux[sub_offsets[k] : sub_offsets[k + 1]]
            final[offsets[i] : offsets[i + 1]] = sub_final[sub_offsets[k] : sub_offsets[k + 1]]
    free = 0
    for i, f in enumerate(found):
        if f is not None:
            aux[offsets[i] : offsets[i + 1]], final[offsets[i] : offsets[i + 1]] = f
            free += offsets[i + 1] - offsets[i]
    return offsets, aux, final, free


def log_generated(ctx: Any, rates: Any, *, computed_by: str) -> None:
    """What came with generate, in extract's log; ``computed_by``: who computed the rest."""
    if rates.generated_tokens:
        total = rates.generated_tokens + rates.fresh_tokens
        rest = f"{rates.fresh_tokens} computed by {computed_by}" if rates.fresh_tokens else f"none computed: {computed_by} never started"
        ctx.log("info", f"extract: {rates.generated_tokens} of {total} tokens came with generate (during_generate); {rest}")
