"""The EAGLE-3 training objective with training-time test (TTT).

For a sample of T tokens, position t at TTT step i reads the token x[t+1+i] and must match the
target's distribution at position t+1+i (what the target predicts for x[t+2+i]), restricted to
the draft vocabulary, where that next token is an assistant token and the target's top choice
lies in the draft vocabulary. Step i's loss is weighted ``step_weight**i`` (0.8 in EAGLE-3).

The target's distribution is recomputed from the stored final hidden state and the target's own
``lm_head`` (read from its safetensors, the rest of the target is never loaded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagleops.pipeline.training.modeling.drafter import DraftCache, Eagle3Drafter

__all__ = ["Eagle3Objective", "target_top", "target_top_and_draft_probs"]


def target_top_and_draft_probs(
    final: torch.Tensor, head: torch.Tensor, draft_head: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's top-1 token id over its whole vocabulary, its distribution over the draft
    vocabulary). The draft probabilities come from the draft rows of the head alone; the top-1
    is found ``chunk`` vocabulary rows at a time, so a 160k vocabulary never holds [B, T, V]
    logits at once. Ties go to the lowest id, as argmax over the whole vocabulary does."""
    probs = torch.softmax((final @ draft_head.to(final.dtype).T).float(), dim=-1)
    return target_top(final, head, chunk), probs


def target_top(final: torch.Tensor, head: torch.Tensor, chunk: int) -> torch.Tensor:
    """The target's top-1 token id after each of ``final``'s states, over its whole vocabulary,
    ``chunk`` head rows at a time (0: all at once)."""
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
    return best_index


class Eagle3Objective(nn.Module):
    """Drafter + frozen target head -> TTT loss; the unit DDP wraps (its forward syncs grads)."""

    target_head: torch.Tensor  # buffers, registered below
    draft_head: torch.Tensor

    def __init__(self, drafter: Eagle3Drafter, target_head: torch.Tensor, *, ttt_length: int, step_weight: float, head_chunk: int = 32768):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)
        self.register_buffer("draft_head", target_head[drafter.draft_ids], persistent=False)
        self.ttt_length, self.step_weight, self.head_chunk = ttt_length, step_weight, head_chunk

    @torch.no_grad()
    def _targets(self, final: torch.Tensor, loss_mask: torch.Tensor, valid_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the target's distribution may be learned, as (batch, position) index rows, and
        that distribution over the draft vocab there: the next token is the target's own, and its
        top choice lies in the draft vocabulary. Only those rows are computed (prompts are most of
        a long chat's tokens and teach nothing)."""
        t = loss_mask.shape[1]
        positions = torch.arange(t, device=final.device)[None, :]
        candidate = torch.zeros_like(loss_mask, dtype=torch.bool)
        candidate[:, :-1] = loss_mask[:, 1:].bool()
        candidate &= positions + 1 < valid_len[:, None]
        where = candidate.nonzero()  # [n, 2]: (batch, position)
        top, probs = target_top_and_draft_probs(final[where[:, 0], where[:, 1]], self.target_head, self.draft_head, self.head_chunk)
        learnable = self.drafter.t2d[top]
        return where[learnable], probs[learnable]

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Step i's loss at position j is against the target's distribution at j + 1 + i, where
        that is learnable (``_targets``); the draft head and its softmax run at those rows only."""
        ids, aux, final, loss_mask, lengths = batch["input_ids"], batch["aux"], batch["final"], batch["loss_mask"], batch["lengths"]
        b, t = ids.shape
        device = ids.device
        where, target_p = self._targets(final, loss_mask, lengths)
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
            hidden, normed = self.drafter.advance(hidden, tokens, positions, step, cache, key_padding)
            rows = where[:, 1] >= shift  # targets this step can reach: the drafter's position is shift earlier
            p = target_p[rows]
            logits = self.drafter.lm_head(normed[where[rows, 0], where[rows, 1] - shift])
            log_q = F.log_softmax(logits.float(), dim=-1)
            count = rows.sum().clamp(min=1)
            loss = -(p * log_q).sum() / count
            with torch.no_grad():
                accuracies.append((logits.argmax(-1) == p.argmax(-1)).sum() / count)
            losses.append(loss.detach())
            total = total + (self.step_weight**step) * loss
        return total, losses, accuracies
