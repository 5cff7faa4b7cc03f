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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import RunConfig
from pipeline.training.drafter import DraftCache, Eagle3Drafter, drafter_config_from_target
from pipeline.training.extract import FeatureShards, pick_device
from pipeline.training.context import StageContext, StageKilled

__all__ = ["Eagle3Objective", "build_drafter", "load_target_tensors", "train"]


def load_target_tensors(model_dir: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Only the named tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors import safe_open

    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
    else:
        weight_map = {}
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = "model.safetensors"
    found: dict[str, torch.Tensor] = {}
    for name in names:
        if name in weight_map:
            with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
                found[name] = f.get_tensor(name)
    return found


def target_head_and_embeddings(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_target_tensors(model_dir, ("lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"))
    embed = tensors.get("model.embed_tokens.weight", tensors.get("model.language_model.embed_tokens.weight"))
    if embed is None:
        raise ValueError(f"{model_dir}: no embed_tokens weight in its safetensors")
    head = tensors.get("lm_head.weight", embed)  # tied embeddings
    return head, embed


def build_drafter(config: RunConfig, aux_layers: tuple[int, int, int], *, seed: int) -> Eagle3Drafter:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    assert config.target is not None
    target_config = AutoConfig.from_pretrained(str(config.target.model))
    vocab = load_file(str(config.prepared_dir / "draft_vocab.safetensors"))
    drafter_config = drafter_config_from_target(target_config, draft_vocab_size=len(vocab["d2t"]), aux_layers=aux_layers)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config)
    _, embed = target_head_and_embeddings(config.target.model)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed.float())
    drafter.set_vocab(vocab["d2t"], vocab["t2d"])
    return drafter


class Eagle3Objective(nn.Module):
    """Drafter + frozen target head -> TTT loss; the unit DDP wraps (its forward syncs grads)."""

    def __init__(self, drafter: Eagle3Drafter, target_head: torch.Tensor, *, ttt_length: int, step_weight: float):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)
        self.ttt_length, self.step_weight = ttt_length, step_weight

    @torch.no_grad()
    def _targets(self, final: torch.Tensor, loss_mask: torch.Tensor, valid_len: torch.Tensor):
        """Target distribution over the draft vocab per position, and where it may be learned."""
        head = self.target_head.to(final.dtype)
        draft_ids = self.drafter.draft_ids
        logits = final @ head.T  # [B, T, V]
        top = logits.argmax(-1)
        probs = torch.softmax(logits[..., draft_ids].float(), dim=-1)
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


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


def _save(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def train(config: RunConfig, ctx: StageContext) -> dict[str, Any]:
    assert config.target is not None
    tc = config.train
    rank, world = _distributed()
    ctx.rank = rank
    device, _ = pick_device(config.target)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    features = FeatureShards(config.features_dir)
    aux_layers = tuple(features.aux_layers)
    drafter = build_drafter(config, aux_layers, seed=tc.seed).to(device)
    head, _ = target_head_and_embeddings(config.target.model)
    objective = Eagle3Objective(drafter, head.float().to(device), ttt_length=tc.ttt_length, step_weight=tc.step_weight)
    model: nn.Module = objective
    if world > 1:
        model = nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)

    n = len(features)
    per_rank = n // world
    steps_per_epoch = max(1, per_rank // tc.batch_size)
    total_steps = steps_per_epoch * tc.epochs
    if tc.max_steps:
        total_steps = min(total_steps, tc.max_steps)
    warmup = max(1, int(tc.warmup_ratio * total_steps)) if tc.warmup_ratio else 0

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    out = config.train_dir
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    step, history = 0, []
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location=device, weights_only=False)
        drafter.load_state_dict(state["drafter"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = state["step"], state["history"]
        ctx.log("info", f"train: resumed at step {step}/{total_steps}")

    def save() -> None:
        if rank == 0:
            weights = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
            _save(checkpoint_path, {"drafter": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                    "step": step, "history": history, "aux_layers": list(aux_layers),
                                    "drafter_config": drafter.config.to_dict()})  # fmt: skip

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    def load(at: int) -> dict[str, torch.Tensor]:
        """The batch of step ``at``: a pure function of (seed, epoch, position, rank)."""
        epoch, in_epoch = divmod(at, steps_per_epoch)
        order = _order(n, tc.seed, epoch)[rank * per_rank : (rank + 1) * per_rank]
        chunk = order[in_epoch * tc.batch_size : (in_epoch + 1) * tc.batch_size]
        batch = _collate([features[i] for i in chunk], torch.device("cpu"), torch.float32)
        return {k: v.pin_memory() for k, v in batch.items()} if device.type == "cuda" else batch

    # One batch is read and collated ahead in a thread while the current one trains, so the
    # accelerator does not wait on feature reads (shards are only touched from that thread).
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
    upcoming = prefetch.submit(load, step) if step < total_steps else None
    started, first_step = time.monotonic(), step
    model.train()
    try:
        while step < total_steps:
            epoch = step // steps_per_epoch
            ctx.checkpoint()
            batch = {k: v.to(device, non_blocking=True) for k, v in upcoming.result().items()}
            upcoming = prefetch.submit(load, step + 1) if step + 1 < total_steps else None
            with autocast:
                loss, losses, accs = model(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            record = {"step": step, "epoch": epoch, "loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0],
                      "step_loss": [round(float(x), 6) for x in losses], "acc": [round(float(x), 4) for x in accs]}  # fmt: skip
            history.append(record)
            if step % tc.log_every == 0 or step == total_steps:
                ctx.metrics(**record)
            ctx.progress(step, total_steps, "steps", loss=record["loss"], acc0=record["acc"][0])
            if step % tc.checkpoint_every == 0:
                save()
    except StageKilled:
        save()
        raise
    finally:
        prefetch.shutdown(wait=True, cancel_futures=True)
    save()
    if rank == 0:
        with open(out / "history.jsonl", "w") as f:
            for record in history:
                f.write(json.dumps(record) + "\n")
    elapsed = time.monotonic() - started
    tail = history[-max(1, min(len(history), 20)) :]
    summary = {
        "steps": step,
        "final_loss": sum(r["loss"] for r in tail) / len(tail) if tail else None,
        "acc": [round(sum(r["acc"][i] for r in tail) / len(tail), 4) for i in range(tc.ttt_length)] if tail else [],
        "steps_per_s": round((step - first_step) / elapsed, 2) if elapsed > 0 else None,
        "world_size": world,
    }
    ctx.metrics(**summary)
    return summary
