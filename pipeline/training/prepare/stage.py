"""prepare: generated conversations -> tokenized shards with loss masks, and the draft vocabulary.

* merge every dataset's ``data.jsonl`` (plus optional pre-tokenized sets), deduplicate by prompt,
  shuffle with a fixed seed, hold out a few prompts for ``eval``;
* turn each reply the target wrote into the sequence it processed: the **target's own chat
  template** renders the prompt the server rendered, then the reply follows exactly as the
  target emitted it (``samples.py``), the loss on what it emitted; the first samples of every
  dataset are checked to train exactly that (``check.py``) before the rest is tokenized;
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

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.config.run import THINKING
from eagleops.pipeline.training.artifacts import PreparedIndex, PreparedShard
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.modeling.profile import target_profile
from eagleops.pipeline.training.modeling.target import require_target
from eagleops.pipeline.training.modeling.thinking_switch import template_kwargs
from eagleops.pipeline.training.modeling.turns import reply_stop_ids
from eagleops.pipeline.training.prepare.chat_template import PrepareError, load_chat_tokenizer
from eagleops.pipeline.training.prepare.check import trained_problems
from eagleops.pipeline.training.prepare.inputs import Sample, fingerprint, read_conversations, read_extra
from eagleops.pipeline.training.prepare.samples import Built, SampleBuilder
from eagleops.pipeline.training.prepare.vocab import write_draft_vocab

__all__ = ["DROPPED_AS", "build_row", "drop_reason", "prepare", "sample_builder"]


CHECKED_PER_DATASET = 8  # samples whose masks are checked before the rest is tokenized
# why a sample is left out; generate skips the first before paying for it (``long_prompts``), so
# here it counts records from before that, or from other tools
PROMPT_FILLS_MAX_LENGTH = "prompt_fills_max_length"
NOTHING_TO_TRAIN = "nothing_the_target_wrote"
DROPPED_AS = {PROMPT_FILLS_MAX_LENGTH: "whose prompt fills max_length", NOTHING_TO_TRAIN: "with no token the target wrote"}


def sample_builder(config: RunConfig, tokenizer: Any) -> SampleBuilder:
    """The builder for this run's target: per thinking mode, the template kwargs generate sent
    and the reply format they give."""
    switch = target_profile(config).thinking_switch
    kwargs = {mode: template_kwargs(config, switch, mode) for mode in THINKING}
    return SampleBuilder.learn(tokenizer, kwargs, reply_stop_ids(tokenizer, require_target(config).model))


def build_row(builder: SampleBuilder, row: dict[str, Any]) -> list[Built]:
    """The samples of one generated record; a reply the template cannot hold names the record."""
    try:
        return builder.build(
            row["messages"],
            row.get("trained"),
            row["thinking"],
            exact=row.get("exact"),
            exact_turns=row.get("exact_turns"),
            finished=row["finished"],
            tools=row.get("tools"),
            served_prompts=row.get("served_prompts"),
        )
    except PrepareError as exc:
        raise PrepareError(f"{row['dataset']}/{row['id']}: {exc}") from None


def drop_reason(built: Built, max_length: int) -> str | None:
    """Why a sample trains nothing (None: it trains something)."""
    if not any(built.mask):
        return NOTHING_TO_TRAIN
    return None if any(built.mask[:max_length]) else PROMPT_FILLS_MAX_LENGTH


def _tokenize_rows(
    builder: SampleBuilder, rows: list[dict[str, Any]], max_length: int, ctx: StageContext
) -> tuple[list[Sample], int, Counter[str]]:
    """Samples with at least one trained token, how many were cut at ``max_length``, and how
    many were left out, by reason. The first samples of each dataset are checked to train what
    the target wrote, before the rest."""
    samples: list[Sample] = []
    truncated = 0
    dropped: Counter[str] = Counter()
    checked: Counter[str] = Counter()
    for i, row in enumerate(rows):
        ctx.checkpoint()
        for built in build_row(builder, row):
            if checked[row["dataset"]] < CHECKED_PER_DATASET:
                checked[row["dataset"]] += 1
                problems = trained_problems(builder.tokenizer, built, row["thinking"], builder.stop_ids, row["finished"])
                if problems:
                    raise PrepareError(
                        f"{row['dataset']}/{row['id']}: the loss mask would not train what the target wrote: {'; '.join(problems)} "
                        "(eagleops inspect RUN.toml shows the sample)"
                    )
            if (reason := drop_reason(built, max_length)) is not None:
                dropped[reason] += 1
                continue
            truncated += built.length > max_length
            samples.append((built.ids[:max_length], built.mask[:max_length]))
        ctx.progress(i + 1, len(rows), "samples")
    return samples, truncated, dropped


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


def _write_held_out(folder: Path, held_out: list[dict[str, Any]], builder: SampleBuilder) -> None:
    """Held-out conversations for eval, each with the prompt ids the server fed the target (the
    thinking mode's template switch, the history as sent), so eval replays what serving sees."""
    with open(folder / "eval.jsonl", "w", encoding="utf-8") as f:
        for row in held_out:
            served = (row.get("served_prompts") or {}).get(len(row["messages"]) - 1)  # what the server fed the target
            prompt_ids = served or builder.served_prompt(row["messages"], row.get("trained"), row["thinking"], tools=row.get("tools"))
            held = {"id": row["id"], "dataset": row["dataset"], "messages": row["messages"][:-1], "prompt_ids": prompt_ids}
            f.write(json.dumps(held, ensure_ascii=False) + "\n")


def _split(config: RunConfig, rows: list[dict[str, Any]], rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(held out for eval, to train on), after a seeded shuffle."""
    rng.shuffle(rows)
    n_eval = 0
    if config.prepare.eval_fraction > 0 and len(rows) > 1:
        n_eval = min(config.prepare.eval_max, max(1, round(config.prepare.eval_fraction * len(rows))))
    return rows[:n_eval], rows[n_eval:]


def _report_differences(ctx: StageContext, builder: SampleBuilder, dropped: Counter[str], max_length: int, rows: int) -> None:
    """What was left out and why, and where the server's ids and our rendering part."""
    if dropped:
        reasons = ", ".join(f"{n} {DROPPED_AS[why]}" for why, n in dropped.most_common())
        ctx.log(
            "warning",
            f"prepare: left out {sum(dropped.values())} samples that train nothing: {reasons} ({max_length}); "
            "`eagleops inspect RUN.toml` shows them",
        )
    if builder.prompt_mismatches:
        ctx.log(
            "warning",
            f"prepare: {builder.prompt_mismatches} of {builder.served_prompts} prompts the server returned differ from the chat template's "
            "rendering of their record; trained on the server's (eagleops inspect RUN.toml shows one)",
        )
    if builder.exact_mismatches:
        ctx.log(
            "warning",
            f"prepare: {builder.exact_mismatches} of {rows} replies re-tokenise differently from the ids the server generated; "
            "trained on the generated ids",
        )


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
    builder = sample_builder(config, tokenizer)
    samples, truncated, dropped = _tokenize_rows(builder, rows, config.prepare.max_length, ctx)
    _report_differences(ctx, builder, dropped, config.prepare.max_length, len(rows))
    mismatches = builder.exact_mismatches
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
    vocab_size = target_profile(config).head_rows
    if counts and max(counts) >= vocab_size:
        raise PrepareError(
            f"prepare: token id {max(counts)} is past the target head's {vocab_size} rows: {target.tokenizer_path} is not this model's tokenizer"
        )
    draft_ids = write_draft_vocab(tmp, counts, vocab_size, config.prepare.draft_vocab_size)
    shards = _write_shards(tmp, samples, config.prepare.shard_samples)
    _write_held_out(tmp, held_out, builder)
    total_assistant = sum(counts.values())
    index = PreparedIndex(
        fingerprint=wanted,
        samples=len(samples),
        tokens=sum(s.tokens for s in shards),
        assistant_tokens=total_assistant,
        duplicates_dropped=duplicates,
        truncated=int(truncated),
        retokenized_mismatches=mismatches,
        dropped=dict(dropped),
        served_prompts=builder.served_prompts,
        prompt_mismatches=builder.prompt_mismatches,
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
