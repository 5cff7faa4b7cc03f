"""The TTT objective computes the draft head and its softmax only at the rows the loss reads:
the same loss, accuracies and gradients as the dense computation over every position (EAGLE-3's
own formulation, and SpecForge's), at a fraction of the cost when prompts are most of a sample."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleops.pipeline.training.modeling.blocks import DraftCache
from eagleops.pipeline.training.train.loss import Eagle3Objective, target_top_and_draft_probs

from .test_decoding import _drafter


def _dense(objective: Eagle3Objective, batch: dict) -> tuple[torch.Tensor, list, list]:
    """Every position through the head; the loss masked afterwards."""
    drafter = objective.drafter
    ids, aux, final, loss_mask, lengths = batch["input_ids"], batch["aux"], batch["final"], batch["loss_mask"], batch["lengths"]
    b, t = ids.shape
    top, target_p = target_top_and_draft_probs(final, objective.target_head, objective.draft_head, 0)
    positions = torch.arange(t)
    next_is_assistant = torch.zeros_like(loss_mask, dtype=torch.bool)
    next_is_assistant[:, :-1] = loss_mask[:, 1:].bool()
    valid = next_is_assistant & drafter.t2d[top] & (positions[None, :] + 1 < lengths[:, None])
    key_padding = positions[None, :] < lengths[:, None]
    cache, hidden = DraftCache.empty(), drafter.fuse(aux)
    total, losses, accs = hidden.new_zeros(()), [], []
    for step in range(objective.ttt_length):
        shift = 1 + step
        tokens = torch.zeros_like(ids)
        tokens[:, : t - shift] = ids[:, shift:]
        p = torch.zeros_like(target_p)
        p[:, : t - shift] = target_p[:, shift:]
        mask = torch.zeros_like(valid)
        mask[:, : t - shift] = valid[:, shift:]
        hidden, logits = drafter.step(hidden, tokens, positions, step, cache, key_padding)
        per_position = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = mask.sum().clamp(min=1)
        loss = (per_position * mask).sum() / count
        accs.append(((logits.argmax(-1) == p.argmax(-1)) & mask).sum() / count)
        losses.append(loss.detach())
        total = total + objective.step_weight**step * loss
    return total, losses, accs


def test_the_sparse_objective_equals_the_dense_one():
    drafter = _drafter(seed=1)
    drafter.t2d.zero_()
    drafter.t2d[drafter.draft_ids[:15]] = True  # some target tops fall outside the draft vocabulary
    generator = torch.Generator().manual_seed(2)
    head = torch.randn(50, 24, generator=generator)
    objective = Eagle3Objective(drafter, head, ttt_length=4, step_weight=0.8, head_chunk=16)
    b, t = 2, 30
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[0, 12:30] = 1
    loss_mask[1, 5:9] = 1
    loss_mask[1, 15:22] = 1  # two replies; sample 1 is padded past 22
    batch = {
        "input_ids": torch.randint(0, 50, (b, t), generator=generator),
        "aux": torch.randn(b, t, 72, generator=generator),
        "final": torch.randn(b, t, 24, generator=generator),
        "loss_mask": loss_mask,
        "lengths": torch.tensor([30, 22]),
    }
    sparse = objective(batch)
    sparse[0].backward()
    sparse_grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    dense = _dense(objective, batch)
    dense[0].backward()
    torch.testing.assert_close(sparse[0], dense[0], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(sparse[1] + sparse[2], dense[1] + dense[2]):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    for name, param in drafter.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(sparse_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert sparse_grads  # the objective trains something
