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

from eagleops.pipeline.files import write_json_atomic
from eagleops.pipeline.training.artifacts import FeaturesIndex

__all__ = [
    "ConsumedShards",
    "cache_bytes",
    "publish_cache",
    "forget_consumed",
    "live_bytes",
    "release_consumed",
    "result_when_stalled",
    "room_for_shard",
    "StallWatch",
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
    finished_under: str = ""  # the run token of the extract a train finished under: nobody frees room any more

    @classmethod
    def read(cls, directory: Path, prepared: str) -> ConsumedShards:
        import json

        try:
            data = json.loads((directory / CONSUMED).read_text())
            found = cls(data["prepared"], list(data["shards"]), str(data.get("finished_under", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(prepared)
        return found if found.prepared == prepared else cls(prepared)

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / CONSUMED, {"prepared": self.prepared, "shards": self.shards, "finished_under": self.finished_under})


def forget_consumed(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / CONSUMED).unlink()


def live_bytes(directory: Path, index: FeaturesIndex) -> int:
    """Bytes of the written shards still on disk. Read from the folder, not from consumed.json:
    a train records a shard as consumed before it deletes the file (a kill between leaves a file
    to delete again, never a consumed shard unrecorded), so for a moment a recorded shard still
    holds its bytes. One listing, however many shards were consumed before."""
    try:
        present = {entry.name for entry in os.scandir(directory)}
    except FileNotFoundError:
        return 0
    return sum(shard.bytes for name, shard in index.shards.items() if name in present)


def cache_bytes(config: Any, index: FeaturesIndex) -> int:
    """The feature shards on disk now: under ``max_cache_gb``, those not yet deleted."""
    if not config.extract.max_cache_gb:
        return sum(shard.bytes for shard in index.shards.values())
    return live_bytes(config.features_dir, index)


def publish_cache(config: Any, index: FeaturesIndex, ctx: Any) -> None:
    """What the console shows beside extract's progress: the cache's bytes against its bound."""
    bound = int(config.extract.max_cache_gb * 1e9) if config.extract.max_cache_gb else 0
    ctx.metrics(cache_bytes=cache_bytes(config, index), cache_bound_bytes=bound, shards=len(index.shards))


def release_consumed(directory: Path, samples_done: int, *, finished: bool = False) -> list[str]:
    """After a checkpoint at ``samples_done`` samples into the (single) epoch: record every shard
    wholly before it as consumed, then delete those files. Returns the names newly released.
    Reads the index afresh: it lists shards only other ranks have read, and the extract running now."""
    index = FeaturesIndex.read(directory)
    consumed = ConsumedShards.read(directory, index.prepared)
    done = set(consumed.shards)
    fresh = [name for name, shard in index.ordered_shards() if shard.first_sample + shard.samples <= samples_done and name not in done]
    finished_under = index.run_token if finished else ""
    if not fresh and finished_under == consumed.finished_under:
        leftovers = [name for name in consumed.shards if (directory / name).exists()]
        if not leftovers:
            return []
    consumed.shards += fresh
    consumed.finished_under = finished_under  # a train running again (more steps) is not finished any more
    consumed.write(directory)
    for name in consumed.shards:  # also any a kill left behind after recording it
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    return fresh


def result_when_stalled(future: Future[Any], directory: Path, rank: int, waiting_for: Callable[[], str | None]) -> Any:
    """``future.result()`` for the training loop. While it blocks on a shard (``waiting_for()``),
    this rank's marker names it, with a count that changes every second: extract judges a marker
    live by its content changing, on its own clock (mtimes on shared storage are another host's)."""
    if future.done():
        return future.result()
    marker = directory / WAITING / f"rank-{rank}"
    marker.parent.mkdir(exist_ok=True)
    beat = 0
    try:
        while True:
            if (shard := waiting_for()) is not None:
                beat += 1
                marker.write_text(f"{shard} {os.getpid()}.{beat}")
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                continue
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()


class StallWatch:
    """Extract's view of the training ranks' markers: a rank is stalled on an unwritten shard
    when its marker names one and has changed within the last 5 s of this clock."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.seen: dict[str, tuple[str, float]] = {}  # marker -> (content, when it last changed)

    def stalled(self, written: dict[str, Any]) -> bool:
        now = time.monotonic()
        try:
            entries = list(os.scandir(self.directory / WAITING))
        except FileNotFoundError:
            return False
        live = False
        for entry in entries:
            try:
                content = Path(entry.path).read_text()
            except OSError:
                continue
            before = self.seen.get(entry.name)
            if before is None:
                self.seen[entry.name] = (content, -1e9)  # first sight: live only once it changes
            elif before[0] != content:
                self.seen[entry.name] = (content, now)
            changed_at = self.seen[entry.name][1]
            live = live or (now - changed_at < 5.0 and content.split(" ", 1)[0] not in written)
        return live


def room_for_shard(config: Any, index: FeaturesIndex, ctx: Any, stalls: StallWatch, next_bytes: int) -> bool:
    """Before extract computes a shard that will take at most ``next_bytes`` on disk: under
    ``extract.max_cache_gb``, block while it would pass the bound. False when a train has
    finished under this extract (nothing will free room: extract stops there)."""
    if not config.extract.max_cache_gb:
        return True
    directory, max_bytes = config.features_dir, int(config.extract.max_cache_gb * 1e9)
    while True:
        consumed = ConsumedShards.read(directory, index.prepared)
        live = live_bytes(directory, index)
        if live == 0 or live + next_bytes <= max_bytes:
            return True
        if ctx.partner_done.is_set() or (consumed.finished_under and consumed.finished_under == index.run_token):
            ctx.log("info", f"extract: stopped at {len(index.shards)} shards: train has finished and the cache is full")
            return False
        if stalls.stalled(index.shards):
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
