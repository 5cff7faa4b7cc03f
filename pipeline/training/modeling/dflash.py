"""The DFlash drafter: a block of tokens drafted in one forward, conditioned on the target's
hidden states by injecting them as keys and values into every layer.

As vLLM's ``qwen3_dflash`` and SGLang's ``dflash`` compute it (``dflash_config`` says what they
read): the target's states at the layers ``aux_layers`` names, concatenated, go through ``fc``
(K·H -> H) and ``hidden_norm``: the *context*. Each layer turns the context into keys and values
with its own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the context's positions, never
through the layer stack. The block (the last verified token, then ``mask_token_id`` in every
other slot, at the positions that follow) runs through Qwen3 decoder layers (``q_norm`` and
``k_norm`` per head) whose queries attend to every context position before the block and to the
whole block, both ways. ``norm``, then the target's own head (frozen, not exported: both engines
share it): slot k drafts the token k positions after the verified one.

Embeddings and head are the target's, frozen; neither is saved (``FROZEN``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagleops.pipeline.training.modeling.blocks import MLP, RMSNorm, rotate_halves

__all__ = ["BlockSession", "DFlashDrafter", "EXPORTED_DFLASH_PREFIXES", "FROZEN"]

EXPORTED_DFLASH_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")
FROZEN = ("embed_tokens.", "lm_head")  # the target's, in every copy of the drafter: never trained, saved or exported


class DFlashAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kv_heads, T, d] keys (normed, rotated) and values of ``x`` [B, T, H]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate_halves(k, cos.unsqueeze(1), sin.unsqueeze(1)), v

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """The block ``x`` [B, Q, H] over the context's keys/values and its own; ``mask`` [B, 1,
        Q, S + Q] (True: attend), None for every key."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate_halves(q, cos.unsqueeze(1), sin.unsqueeze(1))
        k, v = self.keys_values(x, cos, sin)
        keys, values = torch.cat((context[0], k), dim=2), torch.cat((context[1], v), dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, context=None, mask=None):
        """The block ``x`` through the layer; called on the context alone (``context`` None), the
        context's keys and values in this layer (through ``forward``, so FSDP gathers the layer)."""
        if context is None:
            return self.self_attn.keys_values(x, cos, sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    lm_head: torch.Tensor  # the target's head, a buffer (``set_target``)

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.block_size, self.mask_token_id = int(config.block_size), int(config.mask_token_id)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(config.aux_layers) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("lm_head", torch.zeros(config.vocab_size, config.hidden_size), persistent=False)

    def set_target(self, embeddings: torch.Tensor, head: torch.Tensor) -> None:
        """The target's embeddings and output head, which the drafter shares with it."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embeddings.float())
            self.lm_head.copy_(head.float())

    def shard_units(self) -> tuple[nn.Module, ...]:
        """The modules FSDP shards one by one (the frozen embeddings and head stay whole)."""
        return (self.fc, self.hidden_norm, *self.layers, self.norm)

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(like, positions)
        return cos.to(like.dtype), sin.to(like.dtype)

    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the target's states ``aux`` [B, S, K·H] at
        ``positions`` [B, S]: the context a block attends to."""
        hidden = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = self.rope(hidden, positions)
        return [layer(hidden, cos, sin) for layer in self.layers]

    def blocks(self, context, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The normed output [B, Q, H] of blocks ``tokens`` [B, Q] at ``positions`` [B, Q]."""
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rope(x, positions)
        for layer, layer_context in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, layer_context, mask)
        return self.norm(x)

    def block_tokens(self, first: torch.Tensor) -> torch.Tensor:
        """Blocks [..., block_size] starting with ``first`` [...], the mask in every other slot."""
        block = torch.full((*first.shape, self.block_size), self.mask_token_id, dtype=torch.long, device=first.device)
        block[..., 0] = first
        return block

    def session(self) -> BlockSession:
        return BlockSession(self)


@dataclass
class BlockSession:
    """The drafter over one growing sequence, as the engines run it: ``extend`` adds the target's
    states at the next positions (their keys and values are kept), ``propose`` drafts the tokens
    after the last verified one, all in one forward, leaving the context as it was."""

    drafter: DFlashDrafter
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    verified: int | None = None  # the target's own next token: the block's first

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        """``aux`` [1, m, K·H] at the next m positions; ``next_tokens``: the token after each
        (only the last is read: it opens the next block)."""
        positions = torch.arange(self.length, self.length + aux.shape[1], device=aux.device)[None, :]
        for i, (k, v) in enumerate(self.drafter.context(aux, positions)):
            if i < len(self.keys):
                self.keys[i], self.values[i] = torch.cat((self.keys[i], k), dim=2), torch.cat((self.values[i], v), dim=2)
            else:
                self.keys.append(k)
                self.values.append(v)
        self.length += aux.shape[1]
        self.verified = next_tokens[-1]

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        """k target-vocabulary tokens after the verified one (k < block_size), each the top
        choice of its slot."""
        if self.verified is None:
            raise RuntimeError("propose before extend: the drafter has no context")
        d = self.drafter
        if not 0 < k < d.block_size:
            raise ValueError(f"a dflash drafter of block size {d.block_size} drafts 1 to {d.block_size - 1} tokens, not {k}")
        device = d.lm_head.device
        tokens = d.block_tokens(torch.tensor([self.verified], device=device))[:, : k + 1]
        positions = torch.arange(self.length, self.length + k + 1, device=device)[None, :]
        out = d.blocks(list(zip(self.keys, self.values, strict=True)), tokens, positions, None)
        return (out[0, 1:] @ d.lm_head.to(out.dtype).T).argmax(-1).tolist()
