"""The DFlash training objective: many blocks per sample, each drafted in one forward.

As SpecForge (``dflash_family_model.py``) and speculators (``models/dflash``) train it: in each
sample, up to ``anchors`` block starts are drawn at random among positions a whose token and
next token are both reply tokens (the loss mask). A block holds the token at a, then the mask
token in every other slot, at positions a..a+bs-1; it attends to the target's states at every
position before a (the context the engine has when a is the token it just verified) and to its
own slots both ways, never to another block. Slot k (k >= 1) learns the token at a + k, where
that is a reply token inside the sample.

The label is the target's own greedy token there (from the stored final state and the target's
head, as speculators trains DFlash, and what greedy verification accepts); slot k's cross
entropy weighs ``exp(-(k-1)/block_decay)`` (SpecForge's recipe: 7), normalised by the weights'
sum. Anchors are a pure function of (seed, step, rank): a resumed run draws the same ones.

Blocks are computed a group of anchors at a time, so the attention's scores never hold every
block against the whole context at once (there is no flex_attention on a CPU), and each group is
recomputed in backward rather than kept; the logits over the target's whole vocabulary are
computed in row chunks, recomputed in backward too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagleops.pipeline.training.modeling.dflash import DFlashDrafter
from eagleops.pipeline.training.train.loss import target_top

__all__ = ["BlockObjective", "draw_anchors"]

SCORE_BUDGET = 1 << 25  # attention scores (floats) a group of blocks may hold at once
ROW_CHUNK = 2048  # rows of full-vocabulary logits at once


def draw_anchors(
    loss_mask: torch.Tensor, lengths: torch.Tensor, limit: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, N] block starts, ascending, [B, N] which are real): up to ``limit`` per sample,
    uniformly without replacement among positions whose token and next token are reply tokens."""
    b, t = loss_mask.shape
    reply = loss_mask.bool().cpu()
    valid = torch.zeros((b, t), dtype=torch.bool)
    valid[:, :-1] = reply[:, :-1] & reply[:, 1:]
    valid &= torch.arange(t)[None, :] + 1 < lengths.cpu()[:, None]
    width = max(1, min(limit, int(valid.sum(1).max())))
    keys = torch.rand((b, t), generator=generator).masked_fill(~valid, 2.0)
    order = keys.argsort(dim=1)[:, :width]
    real = valid.gather(1, order)
    anchors = torch.where(real, order, torch.full_like(order, t))  # unreal ones last once sorted
    anchors, _ = anchors.sort(dim=1)
    real, _ = real.sort(dim=1, descending=True)
    anchors = anchors.clamp(max=t - 1)
    return anchors.to(loss_mask.device), real.to(loss_mask.device)


def _weighted_ce(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = (hidden @ head.to(hidden.dtype).T).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), ce.detach(), logits.argmax(-1) == labels


class BlockObjective(nn.Module):
    """DFlash drafter + the target's head (the drafter's own) -> the block loss."""

    def __init__(self, drafter: DFlashDrafter, *, anchors: int, block_decay: float, seed: int, rank: int, head_chunk: int):
        super().__init__()
        self.drafter = drafter
        self.anchors, self.block_decay, self.seed, self.rank, self.head_chunk = anchors, block_decay, seed, rank, head_chunk

    def slot_weights(self, device: torch.device) -> torch.Tensor:
        k = torch.arange(self.drafter.block_size, device=device, dtype=torch.float32)
        weights = torch.exp(-(k - 1).clamp(min=0) / self.block_decay) if self.block_decay > 0 else torch.ones_like(k)
        weights[0] = 0.0  # the verified token: given, not drafted
        return weights

    @torch.no_grad()
    def _labels(self, final: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T]: the target's greedy token at each reply position p (from its state at p - 1),
        -1 where there is nothing to learn."""
        b, t = loss_mask.shape
        learnable = torch.zeros((b, t), dtype=torch.bool, device=final.device)
        learnable[:, 1:] = loss_mask[:, 1:].bool()
        learnable &= torch.arange(t, device=final.device)[None, :] < lengths[:, None]
        where = learnable.nonzero()
        labels = torch.full((b, t), -1, dtype=torch.long, device=final.device)
        labels[where[:, 0], where[:, 1]] = target_top(final[where[:, 0], where[:, 1] - 1], self.drafter.lm_head, self.head_chunk)
        return labels

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
        """(loss, each slot's mean cross entropy, each slot's accuracy, {"block_acceptance"}):
        slots 1..block_size-1; the acceptance is the mean over blocks of 1 + the drafts that
        match their labels before the first that does not (what verifying the block accepts)."""
        d = self.drafter
        ids, aux, final, loss_mask, lengths = batch["input_ids"], batch["aux"], batch["final"], batch["loss_mask"], batch["lengths"]
        b, t = ids.shape
        bs, device = d.block_size, ids.device
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(batch["step"]) * 1_009 + self.rank)
        anchors, real = draw_anchors(loss_mask, lengths, self.anchors, generator)
        n = anchors.shape[1]
        offsets = torch.arange(bs, device=device)
        at = anchors[..., None] + offsets  # [B, N, bs]: the position each slot drafts
        labels = self._labels(final, loss_mask, lengths).gather(1, at.clamp(max=t - 1).view(b, -1)).view(b, n, bs)
        ok = real[..., None] & (at < lengths[:, None, None]) & (labels >= 0) & (offsets > 0)
        weights = self.slot_weights(device) * ok
        denominator = weights.sum().clamp(min=1e-6)
        context = d.context(aux, torch.arange(t, device=device)[None, :].expand(b, -1))
        tokens = d.block_tokens(ids.gather(1, anchors))  # [B, N, bs]
        heads = d.config.num_attention_heads
        # g blocks hold g·bs queries against at most t + g·bs keys: the largest g within the budget
        per_query = SCORE_BUDGET / (b * heads)
        queries = (-t + math.sqrt(t * t + 4 * per_query)) / 2
        group = max(1, min(n, int(queries // bs)))
        total = context[0][0].sum() * 0.0  # joined to the graph even where a batch has nothing to learn
        ce_sum = torch.zeros(bs, device=device)
        correct = torch.zeros((b, n, bs), dtype=torch.bool, device=device)
        for start in range(0, n, group):
            stop = min(n, start + group)
            total = total + self._group(context, tokens, anchors, labels, weights, ok, correct, ce_sum, start, stop, lengths) / denominator
        counts = ok.sum((0, 1)).clamp(min=1)
        losses = [(ce_sum[k] / counts[k]).detach() for k in range(1, bs)]
        accuracies = [(correct[..., k] & ok[..., k]).sum() / counts[k] for k in range(1, bs)]
        matched = (correct & ok)[..., 1:].to(torch.int64).cumprod(-1)  # stops at the first wrong draft, or the first unlearnable slot
        acceptance = float((1 + matched.sum(-1))[real].float().mean()) if bool(real.any()) else math.nan
        return total, losses, accuracies, {"block_acceptance": round(acceptance, 4)}

    def _group(self, context, tokens, anchors, labels, weights, ok, correct, ce_sum, start, stop, lengths) -> torch.Tensor:
        """The weighted loss of blocks ``start:stop`` of every sample (their slots' correctness and
        cross entropy noted in ``correct`` and ``ce_sum``)."""
        d = self.drafter
        b, bs, device = anchors.shape[0], d.block_size, anchors.device
        group = anchors[:, start:stop]  # [B, G]
        g = group.shape[1]
        keys = max(1, int(group.max()))  # no block reads the context at or after its own start
        block_of = torch.arange(g, device=device).repeat_interleave(bs)  # [G·bs]: each query's block
        sees_context = torch.arange(keys, device=device)[None, None, :] < group.repeat_interleave(bs, dim=1)[..., None]
        same_block = (block_of[:, None] == block_of[None, :])[None].expand(b, -1, -1)
        mask = torch.cat((sees_context, same_block), dim=-1)[:, None]  # [B, 1, G·bs, keys + G·bs]
        positions = (group[..., None] + torch.arange(bs, device=device)).view(b, -1)
        # recomputed in backward: every group's activations kept at once would grow with the sample
        out = checkpoint(d.blocks, [(k[:, :, :keys], v[:, :, :keys]) for k, v in context], tokens[:, start:stop].reshape(b, -1),
                         positions, mask, use_reentrant=False)  # fmt: skip
        rows = ok[:, start:stop].reshape(b, -1).nonzero()
        if not len(rows):
            return out.sum() * 0.0
        hidden = out[rows[:, 0], rows[:, 1]]
        flat = (rows[:, 0], rows[:, 1] // bs + start, rows[:, 1] % bs)  # (sample, block, slot) of each row
        row_labels, row_weights = labels[flat], weights[flat]
        loss = hidden.new_zeros((), dtype=torch.float32)
        for first in range(0, len(rows), ROW_CHUNK):
            part = slice(first, first + ROW_CHUNK)
            weighted, ce, right = checkpoint(
                _weighted_ce, hidden[part], d.lm_head, row_labels[part], row_weights[part], use_reentrant=False
            )
            loss = loss + weighted
            ce_sum.index_add_(0, flat[2][part], ce.float())
            correct[flat[0][part], flat[1][part], flat[2][part]] = right
        return loss
