"""Pieces every drafter attention shares: RMSNorm, the two rotary layouts, the per-step cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "DraftCache", "RMSNorm", "rotate_halves", "rotate_pairs"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """Llama's and Qwen3's gated MLP."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama lays it out (vLLM's "neox style"): dim i turns with dim i + d/2. ``cos`` and
    ``sin`` are [..., d], each frequency twice (transformers' tables)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as DeepSeek's MLA lays it out (vLLM's ``is_neox_style=False``): dims 2i and 2i + 1
    turn together at frequency i. Same tables as ``rotate_halves``; their first half is used."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


@dataclass
class DraftCache:
    """Keys/values per TTT step: step 0 over all positions, later steps at the query positions.

    Inference keeps step 0's keys from one draft to the next: with ``extending`` set, the next
    keys added continue step 0's (the context grew by the tokens the target accepted) instead of
    opening a step; ``drop_steps`` forgets a draft chain's own steps."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    extending: bool = False

    @classmethod
    def empty(cls) -> DraftCache:
        return cls([], [])

    def add(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.extending and self.keys:
            self.keys[0] = torch.cat((self.keys[0], key), dim=2)
            self.values[0] = torch.cat((self.values[0], value), dim=2)
        else:
            self.keys.append(key)
            self.values.append(value)
        self.extending = False

    def drop_steps(self) -> None:
        del self.keys[1:], self.values[1:]
