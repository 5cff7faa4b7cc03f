"""The EAGLE-3 drafter: one decoder layer over the target's fused low/mid/high features.

Shapes and names follow what SGLang's ``LlamaForCausalLMEagle3`` loads: ``fc`` (3H -> H) fuses
the three auxiliary hidden states; ``midlayer`` is a Llama decoder layer whose q/k/v projections
read 2H (the normed token embedding concatenated with the normed fused hidden state) and whose
residual is the fused hidden state; ``norm`` then ``lm_head`` (H -> draft vocab). Token
embeddings are the target's, frozen and never exported. ``d2t``/``t2d`` map draft ids to target
ids (``target = draft + d2t[draft]``) and mark the target ids in the draft vocabulary.

Training-time test: step 0 reads the target's features; step i > 0 reads the drafter's own
(pre-norm) output of step i - 1 at the same position, with tokens shifted one further and RoPE
positions advanced by i. At step i a query attends causally to step-0 keys and to its own
position's keys of steps 1..i: the attention pattern of drafting i tokens ahead at inference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import ConfigError, InputError
from eagleops.pipeline.training.modeling.blocks import MLP, DraftCache, RMSNorm, rotate_halves
from eagleops.pipeline.training.modeling.dflash import EXPORTED_DFLASH_PREFIXES, DFlashDrafter
from eagleops.pipeline.training.modeling.dflash_config import is_dflash, mask_token
from eagleops.pipeline.training.modeling.drafter_config import DrafterChoice, drafter_config_from_target
from eagleops.pipeline.training.modeling.mla import MLAttention
from eagleops.pipeline.training.modeling.profile import head_and_embeddings, target_config, target_profile
from eagleops.pipeline.training.modeling.target import load_target_tokenizer, require_target
from eagleops.pipeline.training.modeling.ttt_attention import flex_available, ttt_attention

__all__ = ["EXPORTED_PREFIXES", "DraftCache", "DraftSession", "Eagle3Drafter", "build_drafter", "load_exported"]

# what a server loads from an export: the target supplies the embeddings
EXPORTED_PREFIXES = ("midlayer.", "fc.", "fc_norm.", "norm.", "lm_head.", "d2t", "t2d")


class Attention(nn.Module):
    fused = True  # flex_attention where it can run (CUDA): ``ttt_attention``

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

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
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        cache.add(k, v)
        flex = self.fused and flex_available(x, len(cache.keys))
        out = ttt_attention(q, cache.keys, cache.values, query_positions, key_padding, flex=flex)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MidLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        # MLA where the config carries its latent sizes (``drafter_config``), Llama's otherwise
        self.self_attn = MLAttention(config) if getattr(config, "kv_lora_rank", None) else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, cos, sin, cache, query_positions, key_padding):
        residual = hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        hidden = residual + self.self_attn(x, cos, sin, cache, query_positions, key_padding)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    d2t: torch.Tensor  # buffers, registered below
    t2d: torch.Tensor

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        # EAGLE-3.1: each aux layer normed on its own before fc (vLLM's ``fc_norm``), and the state
        # a step hands the next is the post-norm one (``norm_output``)
        eps = config.rms_norm_eps
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, eps) for _ in range(3)) if getattr(config, "fc_norm", False) else None
        )
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def shard_units(self) -> tuple[nn.Module, ...]:
        """The modules FSDP shards one by one (the frozen embeddings stay whole). EAGLE-3.1's
        fc_norm is a ModuleList (no forward of its own): each norm is a unit."""
        return (self.fc, *(self.fc_norm or ()), self.midlayer, self.norm, self.lm_head)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1), strict=True)], dim=-1)
        return self.fc(aux)

    def step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step_index: int,
        cache: DraftCache,
        key_padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step for the positions given: (the state the next step reads, draft-vocab
        logits). The state is the layer's pre-norm output (EAGLE-3) or its normed one (3.1).

        ``positions`` [T] are the absolute positions of the queries (their RoPE advances by
        ``step_index``); step 0 must cover every position later steps attend to.
        """
        state, normed = self.advance(hidden, tokens, positions, step_index, cache, key_padding)
        return state, self.lm_head(normed)

    def advance(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step_index: int,
        cache: DraftCache,
        key_padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` without the head: (the state the next step reads, the normed output the head
        reads). Training applies the head only where the loss needs it."""
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        rope_positions = (positions + step_index)[None, :].expand(hidden.shape[0], -1)
        cos, sin = self.rotary(hidden, rope_positions)
        out = self.midlayer(embeds, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), cache, positions, key_padding)
        normed = self.norm(out)
        return (normed if self.norm_output else out), normed

    # ---- inference: chain drafting ----------------------------------------------------------
    def session(self) -> DraftSession:
        """Drafting over one sequence, with a cache of the context's step-0 keys."""
        return DraftSession(self)


class DraftSession:
    """The drafter over one growing sequence: ``extend`` adds positions whose target features
    and next tokens are known (once each: its step-0 keys are cached), ``propose`` drafts a chain
    of k tokens after the last of them, which leaves the cache as it found it."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.cache = DraftCache.empty()
        self.length = 0  # positions whose step-0 keys the cache holds
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (state, logits) at the last position

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        """``aux`` [1, m, 3H]: the target's features at the next m positions; ``next_tokens``: the
        token after each of them (the last: the target's own next token)."""
        d = self.drafter
        positions = torch.arange(self.length, self.length + aux.shape[1], device=aux.device)
        tokens = torch.tensor([next_tokens], device=aux.device)
        self.cache.extending = True
        hidden, logits = d.step(d.fuse(aux.to(d.fc.weight.dtype)), tokens, positions, 0, self.cache)
        self.length += aux.shape[1]
        self.last = hidden[:, -1:], logits[:, -1:]

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        """k target-vocabulary tokens drafted after the last position, each from the one before."""
        if self.last is None:
            raise RuntimeError("propose before extend: the drafter has no context")
        d = self.drafter
        hidden, logits = self.last
        last = torch.tensor([self.length - 1], device=hidden.device)
        drafts: list[int] = []
        for i in range(k):
            draft = int(logits[0, -1].argmax())
            target_id = draft + int(d.d2t[draft])
            drafts.append(target_id)
            if i + 1 == k:
                break
            hidden, logits = d.step(hidden, torch.tensor([[target_id]], device=hidden.device), last, i + 1, self.cache)
        self.cache.drop_steps()
        return drafts


def build_drafter(config: RunConfig, aux_layers: tuple[int, ...], *, seed: int) -> Eagle3Drafter | DFlashDrafter:
    """A fresh drafter for the target: its geometry, the prepared draft vocabulary (EAGLE-3) or
    the target's head and a mask token (dflash), its frozen embeddings."""
    from safetensors.torch import load_file

    profile = target_profile(config)
    choice = DrafterChoice.from_train(config.train)
    if choice.block:
        return _build_dflash(config, profile, choice, aux_layers, seed)
    if len(aux_layers) != 3:
        raise ConfigError(
            f"{config.source}: the features hold layers {list(aux_layers)} (a dflash drafter's); an EAGLE-3 drafter "
            f"({choice.kind}) reads three: run extract again (it captures them for this drafter)"
        )
    vocab = load_file(str(config.layout.draft_vocab))
    drafter_config = drafter_config_from_target(
        target_config(config),
        draft_vocab_size=len(vocab["d2t"]),
        aux_layers=aux_layers,
        vocab_size=profile.head_rows,
        choice=choice,
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config)
    _, embed = head_and_embeddings(profile)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed.float())
    drafter.set_vocab(vocab["d2t"], vocab["t2d"])
    return drafter


def _build_dflash(config: RunConfig, profile: Any, choice: DrafterChoice, aux_layers: tuple[int, ...], seed: int) -> DFlashDrafter:
    head, embed = head_and_embeddings(profile)
    drafter_config = drafter_config_from_target(
        target_config(config), draft_vocab_size=profile.head_rows, aux_layers=aux_layers, vocab_size=profile.head_rows, choice=choice,
        mask_token_id=mask_token(load_target_tokenizer(require_target(config)), profile.head_rows),
    )  # fmt: skip
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config)
    drafter.set_target(embed, head)
    return drafter


def load_exported(directory: Path, embeddings: torch.Tensor, head: torch.Tensor | None = None) -> Eagle3Drafter | DFlashDrafter:
    """Rebuild a drafter from an export (as a server would), embeddings (and a dflash drafter's
    head) from the target."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, Qwen3Config

    payload = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    if is_dflash(payload):
        if head is None:
            raise ValueError("a dflash drafter drafts with the target's head: pass it")
        payload["aux_layers"] = payload["dflash_config"]["target_layer_ids"]
        payload["mask_token_id"] = payload["dflash_config"]["mask_token_id"]
        dflash = DFlashDrafter(Qwen3Config.from_dict(payload))
        _load_exported_weights(directory, dflash, weights, EXPORTED_DFLASH_PREFIXES)
        dflash.set_target(embeddings, head)
        return dflash.eval()
    drafter = Eagle3Drafter(LlamaConfig.from_dict(payload))
    _load_exported_weights(directory, drafter, weights, EXPORTED_PREFIXES)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embeddings.float())
    return drafter.eval()


def _load_exported_weights(directory: Path, drafter: nn.Module, weights: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> None:
    unexpected = [k for k in weights if not k.startswith(prefixes)]
    if unexpected:
        raise InputError(f"{directory}: unexpected tensors {unexpected[:5]}")
    state: dict[str, Any] = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    missing = [k for k in drafter.load_state_dict(state, strict=False).missing_keys if not k.startswith(("embed_tokens.", "rotary."))]
    if missing:
        raise InputError(f"{directory}: missing tensors {missing[:5]}")
