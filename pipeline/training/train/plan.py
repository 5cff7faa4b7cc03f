"""Where a training run goes, decided from sizes alone: steps per epoch and in all, the warm-up
and the learning-rate curve, which samples each rank's batch of a step holds, and when a
checkpoint is due. A pure object (no torch, no clock, no files), so every rule is tested on its
own and every rank, deciding alike, stays in step with the others."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TrainPlan"]


@dataclass(frozen=True)
class TrainPlan:
    samples: int  # in the features
    world: int  # ranks
    batch_size: int  # per rank
    epochs: int
    max_steps: int  # 0: no cap
    warmup_ratio: float
    checkpoint_every: int
    follow: bool = False  # following extract: a step's batch is the next global batch in shard order
    per_shard: int = 1  # samples a feature shard holds
    cache_bound: bool = False  # trained-on shards are deleted once a checkpoint is past them

    @property
    def global_batch(self) -> int:
        """Samples a step, all ranks: a following train resumes at step x this."""
        return self.batch_size * self.world

    @property
    def per_rank(self) -> int:
        return self.samples // self.world

    @property
    def steps_per_epoch(self) -> int:
        return max(1, (self.samples // self.global_batch) if self.follow else (self.per_rank // self.batch_size))

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total

    @property
    def warmup(self) -> int:
        return max(1, int(self.warmup_ratio * self.total_steps)) if self.warmup_ratio else 0

    def lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to zero."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total_steps - self.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of ``step``."""
        return divmod(step, self.steps_per_epoch)

    def batch(self, order: list[int], in_epoch: int, rank: int) -> list[int]:
        """The samples of rank ``rank``'s batch at step ``in_epoch`` of an epoch whose samples
        come in ``order``: following extract, the next global batch dealt out by rank; otherwise
        each rank's own share of the epoch, batch after batch."""
        if self.follow:
            start = in_epoch * self.global_batch + rank * self.batch_size
            return order[start : start + self.batch_size]
        share = order[rank * self.per_rank : (rank + 1) * self.per_rank]
        return share[in_epoch * self.batch_size : (in_epoch + 1) * self.batch_size]

    def last_of_step(self, order: list[int], in_epoch: int) -> int:
        """The sample of this step's global batch that extract writes last (following it, every
        rank waits for it before the step's collectives)."""
        return order[min((in_epoch + 1) * self.global_batch, self.samples) - 1]

    def consumed(self, step: int) -> int:
        """Samples trained on once ``step`` steps are done."""
        return step * self.global_batch

    def frees_a_shard(self, step: int, saved_step: int) -> bool:
        """Under a cache bound, a step that finishes a shard checkpoints, so the shard can go."""
        if not self.cache_bound:
            return False
        return self.consumed(step) // self.per_shard > self.consumed(saved_step) // self.per_shard

    def checkpoint_due(self, step: int, saved_step: int) -> bool:
        return step % self.checkpoint_every == 0 or self.frees_a_shard(step, saved_step)
