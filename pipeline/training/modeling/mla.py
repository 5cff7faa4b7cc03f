"""DeepSeek's multi-head latent attention for the drafter's one layer, computed as vLLM's
``DeepseekV2MLAAttention`` computes it with ``input_size = 2H`` (``deepseek_eagle3.py``), under
the same names its loader reads.

q = q_b(norm(q_a(x))), split per head into a no-RoPE and a RoPE part; the latent
``kv_a_proj_with_mqa(x)`` splits into c (``kv_lora_rank``) and one RoPE key shared by all heads;
k_nope and v come out of kv_b(norm(c)). RoPE turns adjacent pairs (vLLM's ``is_neox_style=False``)
and, under DeepSeek's yarn, the softmax scale gains ``yarn_get_mscale(factor, mscale_all_dim)**2``
as in vLLM and transformers. Training materialises per-head keys (the latent form is an
inference-time saving, the same numbers)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eagleops.pipeline.training.modeling.blocks import DraftCache, RMSNorm, rotate_pairs
from eagleops.pipeline.training.modeling.ttt_attention import flex_available, ttt_attention

__all__ = ["MLAttention", "mla_softmax_scale"]


def mla_softmax_scale(config: Any) -> float:
    """``(nope + rope) ** -0.5``, times DeepSeek-yarn's mscale squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = dict(getattr(config, "rope_parameters", None) or {})
    factor = float(rope.get("factor") or 1.0)
    if rope.get("rope_type", "default") == "yarn" and factor > 1 and rope.get("mscale_all_dim"):
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    fused = True  # flex_attention where it can run (CUDA): ``ttt_attention``

    def __init__(self, config: Any):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_a_proj = nn.Linear(2 * hidden, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * hidden, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        self.scale = mla_softmax_scale(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache,
        query_positions: torch.Tensor,
        key_padding: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v_dim], dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rope = rotate_pairs(q_rope, cos, sin)
        k_rope = rotate_pairs(k_rope.unsqueeze(1), cos, sin).expand(b, self.heads, t, self.rope)
        query = torch.cat((q_nope, q_rope), dim=-1)
        cache.add(torch.cat((k_nope, k_rope), dim=-1), value.contiguous())
        flex = self.fused and flex_available(x, len(cache.keys))
        out = ttt_attention(query, cache.keys, cache.values, query_positions, key_padding, flex=flex, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.v_dim))
