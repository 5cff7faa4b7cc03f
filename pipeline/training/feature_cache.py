"""Extract and train at once, within a disk bound (``train.overlap_extract``, ``extract.max_cache_gb``).

At a trillion-parameter target's hidden size a token's features are ~57 KB, so a dataset's are
terabytes: waiting for all of them before step 1, or keeping all of them, is what this avoids.

- Extract writes ``index.json`` with the whole layout (sample count, samples per shard) before
  its first shard; a following train reads shard k once the index lists it.
- A following train reads samples in shard order, shuffled within each shard (prepare already
  shuffled across the data), so it never needs a shard that is far ahead.
- With a cache bound, train (rank 0) records the shards it has checkpointed past in
  ``consumed.json``, then deletes them; a kill between the two only leaves a shard to delete on
  the next checkpoint. Extract counts those as done and waits while the shards on disk and not
  yet trained on would pass the bound.
- Deadlock: when every rank is stalled on a shard extract has not written, extract writes it even
  past the bound (a batch can need more shards than the bound holds); each rank that is stalled
  says so with a file of its own in ``.train-waiting/``.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.files import write_json_atomic
from pipeline.training.artifacts import FeaturesIndex

__all__ = [
    "ConsumedShards",
    "forget_consumed",
    "live_bytes",
    "release_consumed",
    "result_when_stalled",
    "room_for_shard",
    "windowed_order",
]

CONSUMED = "consumed.json"
WAITING = ".train-waiting"
POLL_S = 0.25


def windowed_order(samples: int, per_shard: int, seed: int, epoch: int) -> list[int]:
    """Every sample once: shard by shard, shuffled within each shard. A pure function of its
    arguments, so a resumed run reads the same batches."""
    order: list[int] = []
    for first in range(0, samples, per_shard):
        window = list(range(first, min(first + per_shard, samples)))
        random.Random(f"{seed}:{epoch}:{first}").shuffle(window)
        order += window
    return order


@dataclass
class ConsumedShards:
    """``features/consumed.json``: shards a single-epoch train has checkpointed past (and deletes)."""

    prepared: str
    shards: list[str] = field(default_factory=list)
    finished: bool = False  # that train ended: nobody frees room any more
    written_at: float = 0.0  # the file's mtime: a "finished" from before an extract started is stale

    @classmethod
    def read(cls, directory: Path, prepared: str) -> ConsumedShards:
        import json

        try:
            data = json.loads((directory / CONSUMED).read_text())
            found = cls(data["prepared"], list(data["shards"]), bool(data.get("finished", False)))
            found.written_at = (directory / CONSUMED).stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            return cls(prepared)
        return found if found.prepared == prepared else cls(prepared)

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / CONSUMED, {"prepared": self.prepared, "shards": self.shards, "finished": self.finished})


def forget_consumed(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / CONSUMED).unlink()


def live_bytes(directory: Path, index: FeaturesIndex, consumed: ConsumedShards) -> int:
    """Bytes of the shards written and not yet trained past."""
    gone = set(consumed.shards)
    return sum(shard.bytes for name, shard in index.shards.items() if name not in gone)


def release_consumed(directory: Path, index: FeaturesIndex, samples_done: int, *, finished: bool = False) -> list[str]:
    """After a checkpoint at ``samples_done`` samples into the (single) epoch: record every shard
    wholly before it as consumed, then delete those files. Returns the names newly released."""
    consumed = ConsumedShards.read(directory, index.prepared)
    done = set(consumed.shards)
    fresh = [name for name, shard in index.ordered_shards() if shard.first_sample + shard.samples <= samples_done and name not in done]
    if not fresh and not finished and not consumed.finished:
        return []
    consumed.shards += fresh
    consumed.finished = finished  # a train running again (more steps) is not finished any more
    consumed.write(directory)
    for name in consumed.shards:  # also any a kill left behind after recording it
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    return fresh


def result_when_stalled(future: Future[Any], directory: Path, rank: int, waiting_for: Callable[[], str | None]) -> Any:
    """``future.result()`` for the training loop. While it blocks on a shard (``waiting_for()``),
    this rank's marker names it, refreshed every second (a killed rank's goes stale)."""
    if future.done():
        return future.result()
    marker = directory / WAITING / f"rank-{rank}"
    marker.parent.mkdir(exist_ok=True)
    try:
        while True:
            if (shard := waiting_for()) is not None:
                marker.write_text(shard)
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                continue
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()


def _train_stalled(directory: Path, written: dict[str, Any]) -> bool:
    """A rank's training loop waits on a shard not written yet (its reader may not have seen one
    that just landed: that is no stall)."""
    fresh_after = time.time() - 5.0
    try:
        entries = list(os.scandir(directory / WAITING))
    except FileNotFoundError:
        return False
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime > fresh_after and Path(entry.path).read_text() not in written:
                return True
    return False


def room_for_shard(config: Any, index: FeaturesIndex, ctx: Any) -> bool:
    """Before extract computes a shard: under ``extract.max_cache_gb``, block while one more
    would pass the bound. False when the train it waits on has finished (nothing will free room:
    extract stops there)."""
    if not config.extract.max_cache_gb:
        return True
    directory, max_bytes = config.features_dir, int(config.extract.max_cache_gb * 1e9)
    largest = max((shard.bytes for shard in index.shards.values()), default=0)
    while True:
        consumed = ConsumedShards.read(directory, index.prepared)
        live = live_bytes(directory, index, consumed)
        if live == 0 or live + largest <= max_bytes:
            return True
        if consumed.finished and consumed.written_at >= ctx.started_at:
            ctx.log("info", f"extract: stopped at {len(index.shards)} shards: train has finished and the cache is full")
            return False
        if _train_stalled(directory, index.shards):
            _log_at_most_every_minute(
                ctx,
                "warning",
                f"extract: writing past max_cache_gb ({live / 1e9:.3g} GB on disk): a training batch needs more shards than it holds",
            )
            return True
        _log_at_most_every_minute(
            ctx, "info", f"extract: waiting for train to free room ({live / 1e9:.3g} GB of shards not yet trained on)"
        )
        ctx.checkpoint()
        time.sleep(POLL_S)


_last_logged: dict[tuple[int, str], float] = {}


def _log_at_most_every_minute(ctx: Any, level: str, message: str) -> None:
    """Waiting for room is the normal rhythm of a bounded cache: a line a minute, not one per shard."""
    key, now = (id(ctx), level), time.monotonic()
    if now - _last_logged.get(key, -1e9) >= 60:
        _last_logged[key] = now
        ctx.log(level, message)
