"""prepare: generated conversations -> tokenized shards with loss masks, and the draft vocabulary.

* merge every dataset's ``data.jsonl`` (plus optional pre-tokenized sets), deduplicate by prompt,
  shuffle with a fixed seed, hold out a few prompts for ``eval``;
* render each conversation with the **target's own chat template** and mark the assistant turns
  in the loss mask. Spans come from the template itself: the tokens that rendering turn k adds
  after the generation prompt of turns < k are that reply (its end-of-turn token included), so
  training sees exactly what serving will, for any template that renders prefixes consistently;
* count the assistant tokens and keep the N most frequent as the draft vocabulary (``d2t``
  offsets and the ``t2d`` mask of EAGLE-3).

Output in ``OUT/prepared/``: ``shard-*.safetensors`` (``input_ids`` int32, ``loss_mask`` uint8,
``offsets`` int64 of the concatenated samples), ``index.json``, ``draft_vocab.safetensors``,
``eval.jsonl``. Written to a temporary folder and renamed, so a killed prepare leaves nothing half.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.training.artifacts import PreparedIndex, PreparedShard
from pipeline.training.context import StageContext
from pipeline.training.modeling.target import head_rows, require_target
from pipeline.training.modeling.turns import turn_ends
from pipeline.training.prepare.chat_template import PrepareError, exact_mismatch, load_chat_tokenizer, tokenize_samples, with_exact_reply
from pipeline.training.prepare.inputs import Sample, fingerprint, read_conversations, read_extra
from pipeline.training.prepare.vocab import write_draft_vocab

__all__ = ["prepare"]


def _tokenize_rows(tokenizer: Any, rows: list[dict[str, Any]], max_length: int, ctx: StageContext) -> tuple[list[Sample], int, int]:
    """Samples with at least one trained token, how many were cut at ``max_length``, and how
    many replies re-tokenise differently from the ids the server generated."""
    samples: list[Sample] = []
    truncated = mismatches = 0
    ends = turn_ends(tokenizer)  # learned once: each splice locates the reply by them
    for i, row in enumerate(rows):
        ctx.checkpoint()
        try:
            rendered = tokenize_samples(tokenizer, row["messages"], max_length, row.get("trained"))
            last_is_target = row.get("trained") is None or len(row["messages"]) - 1 in row["trained"]
            if row.get("exact") and last_is_target and exact_mismatch(tokenizer, row["messages"], list(row["exact"]), ends):
                mismatches += 1
                rendered[0] = with_exact_reply(tokenizer, row["messages"], rendered[0], list(row["exact"]), max_length, ends)
        except PrepareError as exc:
            raise PrepareError(f"{row['dataset']}/{row['id']}: {exc}") from None
        for ids, mask, full_length in rendered:
            truncated += full_length > len(ids)
            if sum(mask):
                samples.append((ids, mask))
        ctx.progress(i + 1, len(rows), "samples")
    return samples, truncated, mismatches


def _write_shards(folder: Path, samples: list[Sample], per_shard: int) -> list[PreparedShard]:
    import torch
    from safetensors.torch import save_file

    shards = []
    for s in range(0, len(samples), per_shard):
        chunk = samples[s : s + per_shard]
        offsets = [0]
        for ids, _ in chunk:
            offsets.append(offsets[-1] + len(ids))
        name = f"shard-{s // per_shard:05d}.safetensors"
        tensors = {
            "input_ids": torch.tensor([t for ids, _ in chunk for t in ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for _, mask in chunk for m in mask], dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        }
        save_file(tensors, str(folder / name))
        shards.append(PreparedShard(name, len(chunk), offsets[-1]))
    return shards


def _write_held_out(folder: Path, held_out: list[dict[str, Any]]) -> None:
    with open(folder / "eval.jsonl", "w", encoding="utf-8") as f:
        for row in held_out:
            f.write(json.dumps({"id": row["id"], "dataset": row["dataset"], "messages": row["messages"][:-1]}, ensure_ascii=False) + "\n")


def _split(config: RunConfig, rows: list[dict[str, Any]], rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(held out for eval, to train on), after a seeded shuffle."""
    rng.shuffle(rows)
    n_eval = 0
    if config.prepare.eval_fraction > 0 and len(rows) > 1:
        n_eval = min(config.prepare.eval_max, max(1, round(config.prepare.eval_fraction * len(rows))))
    return rows[:n_eval], rows[n_eval:]


def prepare(config: RunConfig, ctx: StageContext) -> PreparedIndex:
    target = require_target(config)
    out = config.prepared_dir
    wanted = fingerprint(config)
    existing = PreparedIndex.read_if_present(out)
    if existing is not None and existing.fingerprint == wanted:
        ctx.log("info", f"prepare: up to date ({existing.samples} samples); skipped")
        return existing
    tokenizer = load_chat_tokenizer(target)
    rows, duplicates = read_conversations(config, ctx)
    rng = random.Random(config.prepare.seed)
    held_out, rows = _split(config, rows, rng)
    samples, truncated, mismatches = _tokenize_rows(tokenizer, rows, config.prepare.max_length, ctx)
    if mismatches:
        ctx.log(
            "warning",
            f"prepare: {mismatches} of {len(rows)} replies re-tokenise differently from the ids the server generated; trained on the generated ids",
        )
    for extra in config.prepare.extra:
        samples += read_extra(extra, config.prepare.max_length)
    if config.prepare.extra:
        rng.shuffle(samples)
    if not samples:
        raise PrepareError("prepare: no usable samples (no generated data, or no assistant tokens)")

    tmp = out.with_name(out.name + ".tmp")  # renamed into place at the end: a kill leaves nothing half
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts: Counter[int] = Counter()
    for ids, mask in samples:
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    # one vocabulary size everywhere: the target head's rows, which t2d, the drafter and the
    # export all index (a tokenizer can be shorter: Qwen3 151,669 ids, 151936 rows)
    vocab_size = head_rows(target.model)
    if counts and max(counts) >= vocab_size:
        raise PrepareError(
            f"prepare: token id {max(counts)} is past the target head's {vocab_size} rows: {target.tokenizer_path} is not this model's tokenizer"
        )
    draft_ids = write_draft_vocab(tmp, counts, vocab_size, config.prepare.draft_vocab_size)
    shards = _write_shards(tmp, samples, config.prepare.shard_samples)
    _write_held_out(tmp, held_out)
    total_assistant = sum(counts.values())
    index = PreparedIndex(
        fingerprint=wanted,
        samples=len(samples),
        tokens=sum(s.tokens for s in shards),
        assistant_tokens=total_assistant,
        duplicates_dropped=duplicates,
        truncated=int(truncated),
        retokenized_mismatches=mismatches,
        held_out=len(held_out),
        max_length=config.prepare.max_length,
        vocab_size=vocab_size,
        draft_vocab_size=len(draft_ids),
        draft_vocab_coverage=round(sum(counts[t] for t in draft_ids) / total_assistant, 6) if total_assistant else 0.0,
        tokenizer=str(target.tokenizer_path),
        shards=tuple(shards),
    )
    index.write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    ctx.metrics(samples=index.samples, tokens=index.tokens, duplicates_dropped=duplicates, draft_vocab_coverage=index.draft_vocab_coverage)
    ctx.log(
        "info",
        f"prepare: {index.samples} samples, {index.tokens} tokens, draft vocab {len(draft_ids)} covers {100 * index.draft_vocab_coverage:.1f}% of assistant tokens",
    )
    return index
