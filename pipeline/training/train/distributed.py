"""One training code path for one process and for ``torchrun``: DDP (gloo on CPU, NCCL on
GPUs), or FSDP2 with ``train.parallel = "fsdp"``. Data is split by rank; rank 0 checkpoints."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from eagleops.pipeline.training.modeling.dflash import DFlashDrafter
from eagleops.pipeline.training.modeling.drafter import Eagle3Drafter

__all__ = ["full_state", "init_distributed", "load_full_state", "parallelize"]


def init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


def _fully_shard(drafter: Eagle3Drafter | DFlashDrafter) -> None:
    """FSDP2 over the drafter's trainable modules, each its own unit; the frozen embeddings stay
    whole on every rank. Units stay gathered through a step's forward: the mid layer runs once
    per TTT step, and gathering it seven times would cost seven all-gathers for nothing."""
    from torch.distributed.fsdp import fully_shard

    for module in drafter.shard_units():
        fully_shard(module, reshard_after_forward=False)


def parallelize(
    objective: nn.Module, drafter: Eagle3Drafter | DFlashDrafter, device: torch.device, *, world: int, sharded: bool
) -> nn.Module:
    """What the training step calls: the objective itself (one process, or FSDP, which shards the
    drafter in place), or the objective under DDP."""
    if sharded:
        _fully_shard(drafter)
        return objective
    if world > 1:
        return nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    return objective


def full_state(drafter: Eagle3Drafter | DFlashDrafter, optimizer: Any, *, sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimiser) state dicts whole. Sharded, gathering is collective: every rank calls
    this, and the whole state lands on the CPU of each."""
    if not sharded:
        return drafter.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(drafter, options=full), get_optimizer_state_dict(drafter, optimizer, options=full)


def load_full_state(
    drafter: Eagle3Drafter | DFlashDrafter, optimizer: Any, model_state: dict[str, Any], optimizer_state: dict[str, Any], *, sharded: bool
) -> None:
    """Whole state dicts into the drafter and optimiser; sharded, each rank keeps its own shard."""
    if not sharded:
        drafter.load_state_dict(model_state, strict=False)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(drafter, model_state, options=full)
    set_optimizer_state_dict(drafter, optimizer, optimizer_state, options=full)
