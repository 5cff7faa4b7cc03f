"""train: the EAGLE-3 drafter on extracted features, with training-time test (``loss``).

AdamW with a cosine schedule and warm-up, gradient clipping, bf16 autocast on CUDA; one code
path for one process and for ``torchrun`` (``distributed``). A checkpoint holds model, optimiser,
schedule and the position in the data order (a pure function of seed and epoch), so a resumed
run follows the same loss curve. With ``train.overlap_extract`` it reads the features an extract
is still writing (``features.reader``), within ``extract.max_cache_gb`` (``features.cache``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import ConfigError
from eagleops.pipeline.training.artifacts import PreparedIndex, TrainResult
from eagleops.pipeline.training.context import StageContext, StageKilled
from eagleops.pipeline.training.features.cache import release_consumed, result_when_stalled, windowed_order
from eagleops.pipeline.training.features.layout import FeatureSet, feature_set_for_run
from eagleops.pipeline.training.features.reader import FeatureShards
from eagleops.pipeline.training.modeling.dflash import DFlashDrafter
from eagleops.pipeline.training.modeling.drafter import build_drafter
from eagleops.pipeline.training.modeling.drafter_config import geometry_mismatches
from eagleops.pipeline.training.modeling.profile import head_and_embeddings, target_profile
from eagleops.pipeline.training.modeling.target import pick_device, require_target
from eagleops.pipeline.training.tracking import Trackers
from eagleops.pipeline.training.train.block_loss import BlockObjective
from eagleops.pipeline.training.train.checkpoints import checkpoint_to_resume, write_checkpoint
from eagleops.pipeline.training.train.data import collate, shuffled_order
from eagleops.pipeline.training.train.distributed import full_state, init_distributed, load_full_state, parallelize
from eagleops.pipeline.training.train.loss import Eagle3Objective
from eagleops.pipeline.training.train.plan import TrainPlan

__all__ = ["train"]


def _features_to_follow(config: RunConfig) -> FeatureSet:
    """The features this run file's extract writes: a following train takes no other index."""
    layers = target_profile(config).num_layers
    return feature_set_for_run(config, PreparedIndex.read(config.prepared_dir).fingerprint, layers)


class _Trainer:
    """One training run: model, optimiser and schedule built once, then step after step."""

    def __init__(self, config: RunConfig, ctx: StageContext):
        target = require_target(config)
        self.config, self.ctx, self.tc = config, ctx, config.train
        self.rank, self.world = init_distributed()
        ctx.rank = self.rank
        device, _ = pick_device(target)
        if self.world > 1 and device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.device = device
        self.follow = self.tc.overlap_extract
        self.features = (
            FeatureShards(config.features_dir, follow=ctx, layout=_features_to_follow(config))
            if self.follow
            else FeatureShards(config.features_dir)
        )
        self.capture = self.features.capture  # what extract wrote: the drafter reads these layers
        self.drafter = build_drafter(config, self.capture.aux_layers, seed=self.tc.seed).to(device)
        objective: nn.Module
        if isinstance(self.drafter, DFlashDrafter):  # its head is the target's, a buffer of its own
            objective = BlockObjective(self.drafter, anchors=self.tc.anchors, block_decay=self.tc.block_decay, seed=self.tc.seed,
                                       rank=self.rank, head_chunk=self.tc.head_chunk)  # fmt: skip
        else:
            head, _ = head_and_embeddings(target_profile(config))
            objective = Eagle3Objective(self.drafter, head.float().to(device), ttt_length=self.tc.ttt_length,
                                        step_weight=self.tc.step_weight, head_chunk=self.tc.head_chunk)  # fmt: skip
        self.sharded = self.world > 1 and self.tc.parallel == "fsdp"
        self.model: nn.Module = parallelize(objective, self.drafter, device, world=self.world, sharded=self.sharded)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.tc.lr, weight_decay=self.tc.weight_decay)
        self.n = len(self.features)
        self.plan = TrainPlan(
            self.n, self.world, self.tc.batch_size, self.tc.epochs, self.tc.max_steps, self.tc.warmup_ratio, self.tc.checkpoint_every,
            follow=self.follow, per_shard=self.features.per_shard, cache_bound=bool(config.extract.max_cache_gb) and self.follow,
        )  # fmt: skip
        self._order_cache: tuple[int, list[int]] = (-1, [])
        self.released, self.released_logged = 0, -1e9  # trained-on shards deleted, when last said
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.plan.lr_factor)
        config.train_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_path = config.layout.checkpoint
        self.step, self.saved_step = 0, 0
        self.history: list[dict[str, Any]] = []
        self.trackers = (  # rank 0 reports for all
            Trackers(config.train_dir, wandb_project=self.tc.wandb_project, run_name=config.name, config=dict(self.tc.__dict__))
            if self.rank == 0
            else None
        )
        self._resume()

    def _resume(self) -> None:
        state = checkpoint_to_resume(self.checkpoint_path, self.device, self.capture, self.config.features_dir)
        if state is None:
            return
        changed = geometry_mismatches(state.drafter_config, self.drafter.config.to_dict())
        if changed:
            raise ConfigError(
                f"{self.checkpoint_path}: trained as another drafter than [train] now asks for ({'; '.join(changed)}); "
                f"delete {self.checkpoint_path.name} to train afresh, or set [train] back"
            )
        # sharded, every rank reads the full state and keeps its own shard of it
        load_full_state(self.drafter, self.optimizer, state.drafter, state.optimizer, sharded=self.sharded)
        self.scheduler.load_state_dict(state.scheduler)
        self.step, self.history, self.saved_step = state.step, state.history, state.step
        if self.follow and state.global_batch and state.global_batch != self.plan.global_batch:
            raise ConfigError(
                f"{self.checkpoint_path}: saved at {state.global_batch} samples a step (batch_size x ranks), now "
                f"{self.plan.global_batch}: a following train's position in the data would not match; use as many ranks"
            )
        if self.plan.cache_bound and self.rank == 0:  # shards recorded as trained on but not yet deleted when a kill came
            release_consumed(self.config.features_dir, self.plan.consumed(self.step))
        self.ctx.log("info", f"train: resumed at step {self.step}/{self.plan.total_steps}")

    def save(self, *, finished: bool = False) -> None:
        self.saved_step = self.step  # on every rank: all of them decide alike when to save next
        if self.sharded or self.rank == 0:  # gathering the shards is collective: every rank takes part, rank 0 writes
            model_state, optimizer_state = full_state(self.drafter, self.optimizer, sharded=self.sharded)
        if self.rank != 0:
            return
        write_checkpoint(self.checkpoint_path, model_state, optimizer_state, self.scheduler.state_dict(), step=self.step,
                         history=self.history, capture=self.capture, drafter_config=self.drafter.config.to_dict(),
                         global_batch=self.plan.global_batch)  # fmt: skip
        self.ctx.metrics(checkpoint_step=self.step, checkpoint_at=time.time())  # the console's "last checkpoint"
        if self.plan.cache_bound:  # only once the checkpoint is past them: a resume never needs them again
            self.released += len(release_consumed(self.config.features_dir, self.plan.consumed(self.step), finished=finished))
            if self.released and (finished or time.monotonic() - self.released_logged > 60):  # a line a minute, not one a shard
                self.ctx.log("info", f"train: {self.released} trained-on shards deleted so far (extract.max_cache_gb)")
                self.released_logged = time.monotonic()

    def _epoch_order(self, epoch: int) -> list[int]:
        """Every sample's place in ``epoch`` (kept for the epoch: a step reads a batch of it)."""
        if self._order_cache[0] != epoch:
            order = (
                windowed_order(self.n, self.features.per_shard, self.tc.seed, epoch)
                if self.follow
                else shuffled_order(self.n, self.tc.seed, epoch)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def load_batch(self, at: int) -> dict[str, torch.Tensor]:
        """The batch of step ``at``: a pure function of (seed, epoch, position, rank)."""
        epoch, in_epoch = self.plan.position(at)
        order = self._epoch_order(epoch)
        if self.follow:
            # every rank waits for the whole global batch's shards here, not inside a collective
            # while another rank waits for extract (a long wait there trips the NCCL watchdog)
            self.features.wait_for(self.plan.last_of_step(order, in_epoch))
        chunk = self.plan.batch(order, in_epoch, self.rank)
        batch = collate([self.features[i] for i in chunk], torch.device("cpu"), torch.float32)
        batch["step"] = torch.tensor(at)  # what a step draws at random (dflash's anchors) is a function of it
        return {k: v.pin_memory() for k, v in batch.items()} if self.device.type == "cuda" else batch

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        epoch, _ = self.plan.position(self.step)
        with autocast:
            loss, losses, accs, *more = self.model(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.tc.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {"step": self.step, "epoch": epoch, "loss": float(loss.detach()), "lr": self.scheduler.get_last_lr()[0],
                "step_loss": [round(float(x), 6) for x in losses], "acc": [round(float(x), 4) for x in accs],
                **(more[0] if more else {})}  # fmt: skip

    def run(self) -> TrainResult:
        # One batch is read and collated ahead in a thread while the current one trains, so the
        # accelerator does not wait on feature reads (shards are only touched from that thread).
        prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        upcoming: Future[dict[str, torch.Tensor]] | None = (
            prefetch.submit(self.load_batch, self.step) if self.step < self.plan.total_steps else None
        )
        started, first_step = time.monotonic(), self.step
        self.model.train()
        try:
            while upcoming is not None:
                self.ctx.checkpoint()
                batch = {k: v.to(self.device, non_blocking=True) for k, v in self._next_batch(upcoming).items()}
                upcoming = prefetch.submit(self.load_batch, self.step + 1) if self.step + 1 < self.plan.total_steps else None
                step_started = time.monotonic()
                record = self.train_step(batch)
                record["tokens_per_s"] = round(float(batch["lengths"].sum()) * self.world / max(1e-9, time.monotonic() - step_started), 1)
                self.history.append(record)
                if self.trackers is not None:
                    self.trackers.log(self.step, record)
                if self.step % self.tc.log_every == 0 or self.step == self.plan.total_steps:
                    self.ctx.metrics(**record)
                self.ctx.progress(self.step, self.plan.total_steps, "steps", loss=record["loss"], acc0=record["acc"][0])
                if self.plan.checkpoint_due(self.step, self.saved_step):
                    self.save()
        except StageKilled:
            self.save()
            raise
        finally:
            prefetch.shutdown(wait=True, cancel_futures=True)
            if self.trackers is not None:
                self.trackers.close()
        self.save(finished=True)
        return self._summary(time.monotonic() - started, first_step)

    def _next_batch(self, upcoming: Future[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not self.follow:
            return upcoming.result()
        return result_when_stalled(upcoming, self.config.features_dir, self.rank, lambda: self.features.waiting_for)

    def _summary(self, elapsed: float, first_step: int) -> TrainResult:
        if self.rank == 0:
            with open(self.config.layout.history, "w") as f:
                for record in self.history:
                    f.write(json.dumps(record) + "\n")
        tail = self.history[-max(1, min(len(self.history), 20)) :]
        return TrainResult(
            steps=self.step,
            final_loss=sum(r["loss"] for r in tail) / len(tail) if tail else None,
            acc=[round(sum(r["acc"][i] for r in tail) / len(tail), 4) for i in range(len(tail[-1]["acc"]))] if tail else [],
            steps_per_s=round((self.step - first_step) / elapsed, 2) if elapsed > 0 else None,
            world_size=self.world,
        )


def train(config: RunConfig, ctx: StageContext) -> TrainResult:
    result = _Trainer(config, ctx).run()
    ctx.metrics(**result.__dict__)
    return result
