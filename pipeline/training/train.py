"""train: the EAGLE-3 drafter on extracted features, with training-time test.

For a sample of T tokens, position t at TTT step i reads the token x[t+1+i] and must match the
target's distribution at position t+1+i (what the target predicts for x[t+2+i]), restricted to
the draft vocabulary, where that next token is an assistant token and the target's top choice
lies in the draft vocabulary. Step i's loss is weighted ``step_weight**i`` (0.8 in EAGLE-3).

The target's distribution is recomputed from the stored final hidden state and the target's own
``lm_head`` (read from its safetensors, the rest of the target is never loaded). AdamW with a
cosine schedule and warm-up, gradient clipping, bf16 autocast on CUDA. One code path for one
process and for ``torchrun`` (DDP; gloo on CPU, NCCL on GPUs): data is split by rank, rank 0
checkpoints. A checkpoint holds model, optimiser, schedule and the position in the data order
(a pure function of seed and epoch), so a resumed run follows the same loss curve.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import RunConfig
from pipeline.errors import ConfigError
from pipeline.training.artifacts import Checkpoint, PreparedIndex, TrainResult
from pipeline.training.context import StageContext, StageKilled
from pipeline.training.drafter import DraftCache, Eagle3Drafter, build_drafter
from pipeline.training.feature_cache import release_consumed, result_when_stalled, windowed_order
from pipeline.training.features import FeatureShards, features_layout
from pipeline.training.target import head_and_embeddings, pick_device, require_target, target_shape
from pipeline.training.tracking import Trackers

__all__ = ["Eagle3Objective", "target_top_and_draft_probs", "train"]


def target_top_and_draft_probs(
    final: torch.Tensor, head: torch.Tensor, draft_head: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's top-1 token id over its whole vocabulary, its distribution over the draft
    vocabulary). The draft probabilities come from the draft rows of the head alone; the top-1
    is found ``chunk`` vocabulary rows at a time, so a 160k vocabulary never holds [B, T, V]
    logits at once. Ties go to the lowest id, as argmax over the whole vocabulary does."""
    probs = torch.softmax((final @ draft_head.to(final.dtype).T).float(), dim=-1)
    vocab = head.shape[0]
    step = vocab if chunk <= 0 else chunk
    best_value: torch.Tensor | None = None
    best_index = torch.zeros(final.shape[:-1], dtype=torch.long, device=final.device)
    for start in range(0, vocab, step):
        value, index = (final @ head[start : start + step].to(final.dtype).T).max(-1)
        if best_value is None:
            best_value, best_index = value, index + start
            continue
        better = value > best_value  # strictly: an equal value in a later chunk loses, as in argmax
        best_value = torch.where(better, value, best_value)
        best_index = torch.where(better, index + start, best_index)
    return best_index, probs


class Eagle3Objective(nn.Module):
    """Drafter + frozen target head -> TTT loss; the unit DDP wraps (its forward syncs grads)."""

    def __init__(self, drafter: Eagle3Drafter, target_head: torch.Tensor, *, ttt_length: int, step_weight: float, head_chunk: int = 32768):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)
        self.register_buffer("draft_head", target_head[drafter.draft_ids], persistent=False)
        self.ttt_length, self.step_weight, self.head_chunk = ttt_length, step_weight, head_chunk

    @torch.no_grad()
    def _targets(self, final: torch.Tensor, loss_mask: torch.Tensor, valid_len: torch.Tensor):
        """Target distribution over the draft vocab per position, and where it may be learned."""
        top, probs = target_top_and_draft_probs(final, self.target_head, self.draft_head, self.head_chunk)
        b, t = loss_mask.shape
        positions = torch.arange(t, device=final.device)[None, :]
        next_is_assistant = torch.zeros_like(loss_mask, dtype=torch.bool)
        next_is_assistant[:, :-1] = loss_mask[:, 1:].bool()
        valid = next_is_assistant & self.drafter.t2d[top] & (positions + 1 < valid_len[:, None])
        return probs, valid

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        ids, aux, final, loss_mask, lengths = batch["input_ids"], batch["aux"], batch["final"], batch["loss_mask"], batch["lengths"]
        b, t = ids.shape
        device = ids.device
        target_p, valid = self._targets(final, loss_mask, lengths)
        positions = torch.arange(t, device=device)
        key_padding = positions[None, :] < lengths[:, None]
        cache = DraftCache.empty()
        hidden = self.drafter.fuse(aux)
        total = hidden.new_zeros(())
        losses, accuracies = [], []
        for step in range(self.ttt_length):
            shift = 1 + step
            tokens = torch.zeros_like(ids)
            tokens[:, : t - shift] = ids[:, shift:]
            p = torch.zeros_like(target_p)
            p[:, : t - shift] = target_p[:, shift:]
            mask = torch.zeros_like(valid)
            mask[:, : t - shift] = valid[:, shift:]
            hidden, logits = self.drafter.step(hidden, tokens, positions, step, cache, key_padding)
            log_q = F.log_softmax(logits.float(), dim=-1)
            per_position = -(p * log_q).sum(-1)
            count = mask.sum().clamp(min=1)
            loss = (per_position * mask).sum() / count
            with torch.no_grad():
                accuracies.append(((logits.argmax(-1) == p.argmax(-1)) & mask).sum() / count)
            losses.append(loss.detach())
            total = total + (self.step_weight**step) * loss
        return total, losses, accuracies


def _collate(samples: list[dict[str, Any]], device, dtype) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    b = len(samples)
    h3 = samples[0]["aux"].shape[-1]
    h = samples[0]["final"].shape[-1]
    ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    aux = torch.zeros((b, width, h3), dtype=dtype)
    final = torch.zeros((b, width, h), dtype=dtype)
    lengths = torch.zeros(b, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = s["input_ids"].long()
        mask[row, :n] = s["loss_mask"].long()
        aux[row, :n] = s["aux"].to(dtype)
        final[row, :n] = s["final"].to(dtype)
        lengths[row] = n
    return {k: v.to(device) for k, v in {"input_ids": ids, "loss_mask": mask, "aux": aux, "final": final, "lengths": lengths}.items()}


def _order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _layout_to_follow(config: RunConfig) -> tuple[Any, ...]:
    """The features layout this run file's extract writes: a following train takes no other index."""
    layers, _ = target_shape(config)
    return features_layout(config, PreparedIndex.read(config.prepared_dir).fingerprint, layers)


def _fully_shard(drafter: Eagle3Drafter) -> None:
    """FSDP2 over the drafter's trainable modules, each its own unit; the frozen embeddings stay
    whole on every rank. Units stay gathered through a step's forward: the mid layer runs once
    per TTT step, and gathering it seven times would cost seven all-gathers for nothing."""
    from torch.distributed.fsdp import fully_shard

    for module in (drafter.fc, drafter.midlayer, drafter.norm, drafter.lm_head):
        fully_shard(module, reshard_after_forward=False)


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


class _Trainer:
    """One training run: model, optimiser and schedule built once, then step after step."""

    def __init__(self, config: RunConfig, ctx: StageContext):
        target = require_target(config)
        self.config, self.ctx, self.tc = config, ctx, config.train
        self.rank, self.world = _distributed()
        ctx.rank = self.rank
        device, _ = pick_device(target)
        if self.world > 1 and device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.device = device
        self.follow = self.tc.overlap_extract
        self.features = (
            FeatureShards(config.features_dir, follow=ctx, layout=_layout_to_follow(config))
            if self.follow
            else FeatureShards(config.features_dir)
        )
        self.aux_layers = tuple(self.features.aux_layers)
        self.drafter = build_drafter(config, self.aux_layers, seed=self.tc.seed).to(device)
        head, _ = head_and_embeddings(target.model)
        objective = Eagle3Objective(
            self.drafter,
            head.float().to(device),
            ttt_length=self.tc.ttt_length,
            step_weight=self.tc.step_weight,
            head_chunk=self.tc.head_chunk,
        )
        self.model: nn.Module = objective
        self.sharded = self.world > 1 and self.tc.parallel == "fsdp"
        if self.sharded:
            _fully_shard(self.drafter)
        elif self.world > 1:
            self.model = nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.tc.lr, weight_decay=self.tc.weight_decay)
        self.n = len(self.features)
        self.per_rank = self.n // self.world
        self.global_batch = self.tc.batch_size * self.world
        # following extract, a step's batch is the next global batch in shard order, dealt out by rank
        self.steps_per_epoch = max(1, (self.n // self.global_batch) if self.follow else (self.per_rank // self.tc.batch_size))
        self.cache_bound = bool(config.extract.max_cache_gb) and self.follow
        self._order_cache: tuple[int, list[int]] = (-1, [])
        self.released, self.released_logged = 0, -1e9  # trained-on shards deleted, when last said
        total = self.steps_per_epoch * self.tc.epochs
        self.total_steps = min(total, self.tc.max_steps) if self.tc.max_steps else total
        self.warmup = max(1, int(self.tc.warmup_ratio * self.total_steps)) if self.tc.warmup_ratio else 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._schedule)
        config.train_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_path = config.train_dir / "checkpoint.pt"
        self.step, self.history, self.saved_step = 0, [], 0
        self.trackers = (  # rank 0 reports for all
            Trackers(config.train_dir, wandb_project=self.tc.wandb_project, run_name=config.name, config=dict(self.tc.__dict__))
            if self.rank == 0
            else None
        )
        self._resume()

    def _schedule(self, step: int) -> float:
        """Linear warm-up, then cosine decay to zero."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total_steps - self.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            return
        state = Checkpoint.load(self.checkpoint_path, map_location=self.device)
        if self.sharded:  # every rank reads the full state and keeps its own shard of it
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

            full = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.drafter, state.drafter, options=full)
            set_optimizer_state_dict(self.drafter, self.optimizer, state.optimizer, options=full)
        else:
            self.drafter.load_state_dict(state.drafter, strict=False)
            self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.step, self.history, self.saved_step = state.step, state.history, state.step
        if self.follow and state.global_batch and state.global_batch != self.global_batch:
            raise ConfigError(
                f"{self.checkpoint_path}: saved at {state.global_batch} samples a step (batch_size x ranks), now "
                f"{self.global_batch}: a following train's position in the data would not match; use as many ranks"
            )
        if self.cache_bound and self.rank == 0:  # shards recorded as trained on but not yet deleted when a kill came
            release_consumed(self.config.features_dir, self.step * self.global_batch)
        self.ctx.log("info", f"train: resumed at step {self.step}/{self.total_steps}")

    def save(self, *, finished: bool = False) -> None:
        self.saved_step = self.step  # on every rank: all of them decide alike when to save next
        if self.sharded:  # gathering the shards is collective: every rank takes part, rank 0 writes
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state = get_model_state_dict(self.drafter, options=full)
            optimizer_state = get_optimizer_state_dict(self.drafter, self.optimizer, options=full)
        elif self.rank == 0:
            model_state, optimizer_state = self.drafter.state_dict(), self.optimizer.state_dict()
        if self.rank != 0:
            return
        weights = {k: v for k, v in model_state.items() if not k.startswith("embed_tokens.")}
        Checkpoint(weights, optimizer_state, self.scheduler.state_dict(), self.step, self.history, list(self.aux_layers),
                   self.drafter.config.to_dict(), self.global_batch).save(self.checkpoint_path)  # fmt: skip
        if self.cache_bound:  # only once the checkpoint is past them: a resume never needs them again
            self.released += len(release_consumed(self.config.features_dir, self.step * self.global_batch, finished=finished))
            if self.released and (finished or time.monotonic() - self.released_logged > 60):  # a line a minute, not one a shard
                self.ctx.log("info", f"train: {self.released} trained-on shards deleted so far (extract.max_cache_gb)")
                self.released_logged = time.monotonic()

    def _frees_a_shard(self) -> bool:
        """Under a cache bound, a step that finishes a shard checkpoints, so the shard can go."""
        if not self.cache_bound:
            return False
        per = self.features.per_shard
        return (self.step * self.global_batch) // per > (self.saved_step * self.global_batch) // per

    def _epoch_order(self, epoch: int) -> list[int]:
        """Every sample's place in ``epoch`` (kept for the epoch: a step reads a batch of it)."""
        if self._order_cache[0] != epoch:
            order = (
                windowed_order(self.n, self.features.per_shard, self.tc.seed, epoch) if self.follow else _order(self.n, self.tc.seed, epoch)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def load_batch(self, at: int) -> dict[str, torch.Tensor]:
        """The batch of step ``at``: a pure function of (seed, epoch, position, rank)."""
        epoch, in_epoch = divmod(at, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        if self.follow:
            start = in_epoch * self.global_batch
            # every rank waits for the whole global batch's shards here, not inside a collective
            # while another rank waits for extract (a long wait there trips the NCCL watchdog)
            self.features.wait_for(order[min(start + self.global_batch, self.n) - 1])
            chunk = order[start + self.rank * self.tc.batch_size : start + (self.rank + 1) * self.tc.batch_size]
        else:
            chunk = order[self.rank * self.per_rank : (self.rank + 1) * self.per_rank][
                in_epoch * self.tc.batch_size : (in_epoch + 1) * self.tc.batch_size
            ]
        batch = _collate([self.features[i] for i in chunk], torch.device("cpu"), torch.float32)
        return {k: v.pin_memory() for k, v in batch.items()} if self.device.type == "cuda" else batch

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        epoch = self.step // self.steps_per_epoch
        with autocast:
            loss, losses, accs = self.model(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.tc.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {"step": self.step, "epoch": epoch, "loss": float(loss.detach()), "lr": self.scheduler.get_last_lr()[0],
                "step_loss": [round(float(x), 6) for x in losses], "acc": [round(float(x), 4) for x in accs]}  # fmt: skip

    def run(self) -> TrainResult:
        # One batch is read and collated ahead in a thread while the current one trains, so the
        # accelerator does not wait on feature reads (shards are only touched from that thread).
        prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        upcoming: Future[dict[str, torch.Tensor]] | None = (
            prefetch.submit(self.load_batch, self.step) if self.step < self.total_steps else None
        )
        started, first_step = time.monotonic(), self.step
        self.model.train()
        try:
            while upcoming is not None:
                self.ctx.checkpoint()
                batch = {k: v.to(self.device, non_blocking=True) for k, v in self._next_batch(upcoming).items()}
                upcoming = prefetch.submit(self.load_batch, self.step + 1) if self.step + 1 < self.total_steps else None
                step_started = time.monotonic()
                record = self.train_step(batch)
                record["tokens_per_s"] = round(float(batch["lengths"].sum()) * self.world / max(1e-9, time.monotonic() - step_started), 1)
                self.history.append(record)
                if self.trackers is not None:
                    self.trackers.log(self.step, record)
                if self.step % self.tc.log_every == 0 or self.step == self.total_steps:
                    self.ctx.metrics(**record)
                self.ctx.progress(self.step, self.total_steps, "steps", loss=record["loss"], acc0=record["acc"][0])
                if self.step % self.tc.checkpoint_every == 0 or self._frees_a_shard():
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
            with open(self.config.train_dir / "history.jsonl", "w") as f:
                for record in self.history:
                    f.write(json.dumps(record) + "\n")
        tail = self.history[-max(1, min(len(self.history), 20)) :]
        return TrainResult(
            steps=self.step,
            final_loss=sum(r["loss"] for r in tail) / len(tail) if tail else None,
            acc=[round(sum(r["acc"][i] for r in tail) / len(tail), 4) for i in range(self.tc.ttt_length)] if tail else [],
            steps_per_s=round((self.step - first_step) / elapsed, 2) if elapsed > 0 else None,
            world_size=self.world,
        )


def train(config: RunConfig, ctx: StageContext) -> TrainResult:
    result = _Trainer(config, ctx).run()
    ctx.metrics(**result.__dict__)
    return result
