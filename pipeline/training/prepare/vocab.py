"""The reduced draft vocabulary of EAGLE-3: the most frequent assistant tokens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from eagleops.pipeline.training.artifacts import DRAFT_VOCAB

__all__ = ["build_draft_vocab", "write_draft_vocab"]


def build_draft_vocab(counts: Counter[int], vocab_size: int, draft_size: int) -> tuple[list[int], list[int], list[bool]]:
    """The ``draft_size`` most frequent ids (ties: lower id first), padded with unseen ids, sorted.

    Returns (draft_ids, d2t, t2d): ``target = draft + d2t[draft]`` and ``t2d[target]``.
    """
    draft_size = min(draft_size, vocab_size)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [token for token, _ in ranked[:draft_size]]
    if len(chosen) < draft_size:
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: draft_size - len(chosen)]
    chosen.sort()
    d2t = [target - i for i, target in enumerate(chosen)]
    t2d = [False] * vocab_size
    for target in chosen:
        t2d[target] = True
    return chosen, d2t, t2d


def write_draft_vocab(folder: Path, counts: Counter[int], vocab_size: int, draft_size: int) -> list[int]:
    import torch
    from safetensors.torch import save_file

    draft_ids, d2t, t2d = build_draft_vocab(counts, vocab_size, draft_size)
    tensors = {
        "d2t": torch.tensor(d2t, dtype=torch.int64),
        "t2d": torch.tensor(t2d, dtype=torch.bool),
        "draft_ids": torch.tensor(draft_ids, dtype=torch.int64),
    }
    save_file(tensors, str(folder / DRAFT_VOCAB))
    return draft_ids
