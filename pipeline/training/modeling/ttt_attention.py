"""The drafter's attention under training-time test, two ways that compute the same thing.

At TTT step i a query at position p attends to the step-0 keys at positions <= p (not padding)
and to its own position's keys of steps 1..i. ``eager`` does that with one matmul over the
step-0 keys and one dot product per later step (any device, and what inference's single query
uses). ``flex`` does it in one fused kernel: PyTorch's flex_attention over the step keys laid end
to end, with a block mask that skips every block the pattern leaves empty (nearly all of the
later steps' keys). It is what SpecForge trains with on a GPU; flex_attention has no backward on
a CPU, so it is used on CUDA only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["flex_available", "ttt_attention"]


@functools.cache
def _compiled() -> tuple[Any, Any] | None:
    """(flex_attention, create_block_mask), compiled once; None where this torch lacks them."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # dynamic shapes after the first recompile (batches are padded to their own longest sample),
    # and the block mask built compiled, never as a dense [t, keys] tensor, as SpecForge builds them
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def flex_available(x: torch.Tensor, steps: int) -> bool:
    """Fused for TTT steps past the first, with many queries (training); step 0 is plain causal
    SDPA already, and inference's drafts are one query each."""
    return x.is_cuda and x.shape[1] > 1 and steps > 1 and _compiled() is not None


def _prefix_mask(query_positions: torch.Tensor, key_padding: torch.Tensor | None, s0: int, device: torch.device) -> torch.Tensor:
    allowed = torch.arange(s0, device=device)[None, :] <= query_positions[:, None]  # [t, s0]: causal in absolute position
    allowed = allowed[None, None]
    return allowed & key_padding[:, None, None, :] if key_padding is not None else allowed


def _eager(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], allowed: torch.Tensor, scale: float) -> torch.Tensor:
    k0, v0 = keys[0], values[0]
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=allowed, scale=scale)
    s0 = k0.shape[2]
    scores = torch.matmul(q, k0.transpose(2, 3)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    diagonal = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights[..., :s0], v0)
    for j, vj in enumerate(values[1:]):
        out = out + weights[..., s0 + j : s0 + j + 1] * vj
    return out


def _flex(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    compiled = _compiled()
    if compiled is None:  # flex_available said otherwise
        raise RuntimeError("flex_attention is not available in this torch")
    flex_attention, create_block_mask = compiled
    b, _, t, _ = q.shape
    s0 = keys[0].shape[2]
    padding = key_padding if key_padding is not None else torch.ones((b, s0), dtype=torch.bool, device=q.device)

    def pattern(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        prefix = (kv_idx <= query_positions[q_idx]) & padding[batch, kv_idx.clamp(max=s0 - 1)]
        own = (kv_idx - s0) % t == q_idx  # a later step's key at the query's own position
        return torch.where(kv_idx < s0, prefix, own)

    length = s0 + (len(keys) - 1) * t
    mask = create_block_mask(pattern, b, None, t, length, device=q.device)
    key, value = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return flex_attention(q, key, value, block_mask=mask, scale=scale)


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    *,
    flex: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """[b, heads, t, d_v] out of queries ``q`` over the step keys and values so far (each [b,
    heads, t, d], step 0's over every position); softmax scale ``scale``, else ``d ** -0.5``."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if flex:
        return _flex(q, keys, values, query_positions, key_padding, scale)
    return _eager(q, keys, values, _prefix_mask(query_positions, key_padding, keys[0].shape[2], q.device), scale)
