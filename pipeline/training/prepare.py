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

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import InputError
from pipeline.training.artifacts import PreparedIndex, PreparedShard
from pipeline.training.context import StageContext
from pipeline.training.target import require_target
from pipeline.training.vocab import build_draft_vocab

__all__ = ["PrepareError", "exact_mismatch", "prepare", "tokenize_conversation", "tokenize_samples", "with_exact_reply"]

Sample = tuple[list[int], list[int]]  # (input_ids, loss_mask)


class PrepareError(InputError):
    """Generated records, a pre-tokenized set or a chat template that prepare cannot use."""


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)) if messages else []


def _inline(message: dict[str, Any]) -> dict[str, Any]:
    turn = {key: value for key, value in message.items() if key != "reasoning_content"}
    turn["content"] = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    return turn


def _with_renderable_reasoning(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each turn's thinking where the template renders it: its
    ``reasoning_content`` field (Qwen3, Kimi-K2 style), else ``<think>`` inline in the content (the
    form templates that keep it in content expect). A template that shows neither is refused: the
    drafter would never see what the target spends most of its decoding on."""
    out = list(messages)
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("reasoning_content"):
            continue
        plain = {key: value for key, value in message.items() if key != "reasoning_content"}
        shown = _render(tokenizer, [*out[:k], message])
        if shown != _render(tokenizer, [*out[:k], plain]):
            continue
        inline = _inline(message)
        if message["reasoning_content"] in tokenizer.decode(_render(tokenizer, [*out[:k], inline])):
            out[k] = inline
            continue
        raise PrepareError(
            f"the chat template renders no thinking (turn {k}: neither `reasoning_content` nor <think> in the content); "
            'use the target\'s own template, or thinking = "drop" for this dataset'
        )
    return out


def tokenize_samples(
    tokenizer: Any, messages: list[dict[str, Any]], max_length: int, trained: Collection[int] | None = None
) -> list[tuple[list[int], list[int], int]]:
    """[(input_ids, loss_mask, untruncated length)] of one conversation rendered by the tokenizer's
    chat template; the loss mask covers each assistant turn the target wrote (``trained``: their
    indices; None: every assistant turn), thinking and answer.

    Spans come from the template itself: the tokens that rendering turn k adds after the
    generation prompt of the turns before it. Templates that drop earlier turns' thinking from
    the history (Qwen3's do) render such a turn differently once the conversation goes on: that
    turn is then a sample of its own, rendered as the target saw it when it wrote it."""
    messages = _with_renderable_reasoning(tokenizer, messages)
    full = _render(tokenizer, messages)
    mask = [0] * len(full)
    separate: list[tuple[list[int], list[int], int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or (trained is not None and k not in trained):
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True)
        # the last turn's render is the whole conversation: no need to render it twice
        through = full if k + 1 == len(messages) else _render(tokenizer, messages[: k + 1])
        if through[: len(before)] != before:
            raise PrepareError(
                f"the chat template does not render conversations prefix-consistently, so assistant spans cannot be located (turn {k})"
            )
        if full[: len(through)] == through:
            mask[len(before) : len(through)] = [1] * (len(through) - len(before))
        elif message.get("reasoning_content"):
            own = [0] * len(before) + [1] * (len(through) - len(before))
            separate.append((through[:max_length], own[:max_length], len(through)))
        else:
            raise PrepareError(
                f"the chat template does not render conversations prefix-consistently, so assistant spans cannot be located (turn {k})"
            )
    return [(full[:max_length], mask[:max_length], len(full)), *separate]


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]], max_length: int) -> tuple[list[int], list[int], int]:
    """(input_ids, loss_mask, untruncated length) of a conversation that renders as one sample."""
    return tokenize_samples(tokenizer, messages, max_length)[0]


def exact_mismatch(tokenizer: Any, messages: list[dict[str, Any]], generated: list[int]) -> bool:
    """Whether the last reply, re-tokenised by the template, differs from the ids the server generated."""
    before = _render(tokenizer, messages[:-1], generation_prompt=True)
    span = _render(tokenizer, messages)[len(before) :]
    eos = tokenizer.eos_token_id
    body = generated[:-1] if generated and generated[-1] == eos else generated
    return span[: len(body)] != body


def with_exact_reply(
    tokenizer: Any, messages: list[dict[str, Any]], sample: tuple[list[int], list[int], int], generated: list[int], max_length: int
) -> tuple[list[int], list[int], int]:
    """The sample with its last reply as the ids the server generated (thinking included), where
    the template's re-tokenisation differs: the drafter learns what the target really produced.
    Only where the template ends the reply with the end-of-sequence token, so the splice is exact."""
    ids, mask, _ = sample
    before = _render(tokenizer, messages[:-1], generation_prompt=True)
    full = _render(tokenizer, messages)
    eos = tokenizer.eos_token_id
    body = generated[:-1] if generated and generated[-1] == eos else list(generated)
    span = full[len(before) :]
    if not body or span[: len(body)] == body or not span or span[-1] != eos or len(full) != len(before) + len(span):
        return sample
    spliced = before + body + [eos]
    spliced_mask = (mask + [0] * len(full))[: len(before)] + [1] * (len(body) + 1)
    return spliced[:max_length], spliced_mask[:max_length], len(spliced)


def _prompt_key(messages: list[dict[str, str]]) -> str:
    prompt = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    return hashlib.blake2b(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode(), digest_size=12).hexdigest()


def _turn(message: dict[str, Any], keep_thinking: bool) -> dict[str, Any]:
    turn = {"role": message["role"], "content": message["content"]}
    turn.update({key: message[key] for key in ("tool_calls", "tool_call_id", "name") if key in message})  # for the template
    if keep_thinking and message.get("reasoning_content"):
        turn["reasoning_content"] = message["reasoning_content"]
    return turn


def _read_conversations(config: RunConfig, ctx: StageContext) -> tuple[list[dict[str, Any]], int]:
    seen: set[str] = set()
    rows, duplicates = [], 0
    for ds in config.datasets:
        path = config.output_dir / ds.name / "data.jsonl"
        if not path.exists():
            ctx.log("warning", f"prepare: {path} missing (dataset {ds.name} not generated); skipped")
            continue
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                    messages = record["conversations"]
                    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
                        raise ValueError("conversations must end with an assistant turn")
                    keep_thinking = record.get("thinking", "keep") == "keep"
                    messages = [_turn(m, keep_thinking) for m in messages]
                except (ValueError, KeyError, TypeError) as exc:
                    raise PrepareError(f"{path}:{line_no}: conversations: {exc}") from None
                key = _prompt_key(messages)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
                exact = record.get("completion_token_ids")
                trained = record.get("target_turns")  # absent in older outputs: every assistant turn
                rows.append(
                    {
                        "key": key,
                        "id": str(record.get("id", key)),
                        "dataset": ds.name,
                        "messages": messages,
                        "exact": exact,
                        "trained": trained,
                    }
                )
    return rows, duplicates


def _read_extra(path: Path, max_length: int) -> list[Sample]:
    samples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids, mask = row["input_ids"], row["loss_mask"]
                if len(ids) != len(mask) or not all(isinstance(i, int) for i in ids):
                    raise ValueError("input_ids and loss_mask must be integer lists of equal length")
            except (ValueError, KeyError, TypeError) as exc:
                raise PrepareError(f"{path}:{line_no}: {exc}") from None
            samples.append((ids[:max_length], [int(bool(m)) for m in mask[:max_length]]))
    return samples


def _fingerprint(config: RunConfig) -> str:
    h = hashlib.blake2b(digest_size=12)
    for ds in config.datasets:
        manifest = config.output_dir / ds.name / "manifest.json"
        h.update(ds.name.encode())
        h.update(manifest.read_bytes() if manifest.exists() else b"-")
    for extra in config.prepare.extra:
        h.update(str(extra).encode())
        h.update(str(extra.stat().st_size if extra.exists() else -1).encode())
    tokenizer = require_target(config).tokenizer_path
    h.update(json.dumps([str(tokenizer), config.prepare.__dict__], default=str, sort_keys=True).encode())
    return h.hexdigest()


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{path}: the tokenizer has no chat template")
    return tokenizer


def _tokenize_rows(tokenizer: Any, rows: list[dict[str, Any]], max_length: int, ctx: StageContext) -> tuple[list[Sample], int, int]:
    """Samples with at least one trained token, how many were cut at ``max_length``, and how
    many replies re-tokenise differently from the ids the server generated."""
    samples: list[Sample] = []
    truncated = mismatches = 0
    for i, row in enumerate(rows):
        ctx.checkpoint()
        try:
            rendered = tokenize_samples(tokenizer, row["messages"], max_length, row.get("trained"))
            last_is_target = row.get("trained") is None or len(row["messages"]) - 1 in row["trained"]
            if row.get("exact") and last_is_target and exact_mismatch(tokenizer, row["messages"], list(row["exact"])):
                mismatches += 1
                rendered[0] = with_exact_reply(tokenizer, row["messages"], rendered[0], list(row["exact"]), max_length)
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


def _write_draft_vocab(folder: Path, counts: Counter[int], vocab_size: int, draft_size: int) -> list[int]:
    import torch
    from safetensors.torch import save_file

    draft_ids, d2t, t2d = build_draft_vocab(counts, vocab_size, draft_size)
    tensors = {
        "d2t": torch.tensor(d2t, dtype=torch.int64),
        "t2d": torch.tensor(t2d, dtype=torch.bool),
        "draft_ids": torch.tensor(draft_ids, dtype=torch.int64),
    }
    save_file(tensors, str(folder / "draft_vocab.safetensors"))
    return draft_ids


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
    fingerprint = _fingerprint(config)
    existing = PreparedIndex.read_if_present(out)
    if existing is not None and existing.fingerprint == fingerprint:
        ctx.log("info", f"prepare: up to date ({existing.samples} samples); skipped")
        return existing
    tokenizer = _load_tokenizer(target.tokenizer_path)
    rows, duplicates = _read_conversations(config, ctx)
    rng = random.Random(config.prepare.seed)
    held_out, rows = _split(config, rows, rng)
    samples, truncated, mismatches = _tokenize_rows(tokenizer, rows, config.prepare.max_length, ctx)
    if mismatches:
        ctx.log(
            "warning",
            f"prepare: {mismatches} of {len(rows)} replies re-tokenise differently from the ids the server generated; trained on the generated ids",
        )
    for extra in config.prepare.extra:
        samples += _read_extra(extra, config.prepare.max_length)
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
    draft_ids = _write_draft_vocab(tmp, counts, len(tokenizer), config.prepare.draft_vocab_size)
    shards = _write_shards(tmp, samples, config.prepare.shard_samples)
    _write_held_out(tmp, held_out)
    total_assistant = sum(counts.values())
    index = PreparedIndex(
        fingerprint=fingerprint,
        samples=len(samples),
        tokens=sum(s.tokens for s in shards),
        assistant_tokens=total_assistant,
        duplicates_dropped=duplicates,
        truncated=int(truncated),
        retokenized_mismatches=mismatches,
        held_out=len(held_out),
        max_length=config.prepare.max_length,
        vocab_size=len(tokenizer),
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
