"""What a training step reads: samples in a seeded order, padded into one batch."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["collate", "shuffled_order"]


def collate(samples: list[dict[str, Any]], device, dtype) -> dict[str, torch.Tensor]:
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


def shuffled_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
