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
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.training.context import StageContext

__all__ = ["PrepareError", "build_draft_vocab", "load_prepared", "prepare", "tokenize_conversation"]


class PrepareError(ValueError):
    pass


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int) -> tuple[list[int], list[int], int]:
    """(input_ids, loss_mask, untruncated length) of one conversation rendered by the
    tokenizer's chat template."""
    full = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
    mask = [0] * len(full)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=True)) if k else []
        # the last turn's render is the whole conversation: no need to render it twice
        through = full if k + 1 == len(messages) else _ids(tokenizer.apply_chat_template(messages[: k + 1], tokenize=True))
        if full[: len(through)] != through or through[: len(before)] != before:
            raise PrepareError(
                "the chat template does not render conversations prefix-consistently, so assistant spans "
                f"cannot be located (turn {k})"
            )
        for i in range(len(before), len(through)):
            mask[i] = 1
    return full[:max_length], mask[:max_length], len(full)


def build_draft_vocab(counts: Counter, vocab_size: int, draft_size: int) -> tuple[list[int], list[int], list[bool]]:
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


def _prompt_key(messages: list[dict[str, str]]) -> str:
    prompt = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    return hashlib.blake2b(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode(), digest_size=12).hexdigest()


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
                    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
                except (ValueError, KeyError, TypeError) as exc:
                    raise PrepareError(f"{path}:{line_no}: conversations: {exc}") from None
                key = _prompt_key(messages)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
                rows.append({"key": key, "id": str(record.get("id", key)), "dataset": ds.name, "messages": messages})
    return rows, duplicates


def _read_extra(path: Path, max_length: int) -> list[tuple[list[int], list[int]]]:
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
    assert config.target is not None
    h.update(json.dumps([str(config.target.tokenizer_path), config.prepare.__dict__], default=str, sort_keys=True).encode())
    return h.hexdigest()


def prepare(config: RunConfig, ctx: StageContext) -> dict[str, Any]:
    if config.target is None:
        raise PrepareError("prepare needs a [target] table (its tokenizer and chat template)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out = config.prepared_dir
    fingerprint = _fingerprint(config)
    index_path = out / "index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        if index.get("fingerprint") == fingerprint:
            ctx.log("info", f"prepare: up to date ({index['samples']} samples); skipped")
            return index
    tokenizer = AutoTokenizer.from_pretrained(str(config.target.tokenizer_path))
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{config.target.tokenizer_path}: the tokenizer has no chat template")
    rows, duplicates = _read_conversations(config, ctx)
    rng = random.Random(config.prepare.seed)
    rng.shuffle(rows)
    n_eval = 0
    if config.prepare.eval_fraction > 0 and len(rows) > 1:
        n_eval = min(config.prepare.eval_max, max(1, round(config.prepare.eval_fraction * len(rows))))
    held_out, rows = rows[:n_eval], rows[n_eval:]

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    samples: list[tuple[list[int], list[int]]] = []
    truncated = 0
    for i, row in enumerate(rows):
        ctx.checkpoint()
        try:
            ids, mask, full_length = tokenize_conversation(tokenizer, row["messages"], config.prepare.max_length)
        except PrepareError as exc:
            raise PrepareError(f"{row['dataset']}/{row['id']}: {exc}") from None
        truncated += full_length > len(ids)
        if sum(mask):
            samples.append((ids, mask))
        ctx.progress(i + 1, len(rows), "samples")
    for extra in config.prepare.extra:
        samples += _read_extra(extra, config.prepare.max_length)
    if config.prepare.extra:
        rng.shuffle(samples)
    if not samples:
        raise PrepareError("prepare: no usable samples (no generated data, or no assistant tokens)")

    counts: Counter = Counter()
    for ids, mask in samples:
        counts.update(t for t, m in zip(ids, mask) if m)
    vocab_size = len(tokenizer)
    draft_ids, d2t, t2d = build_draft_vocab(counts, vocab_size, config.prepare.draft_vocab_size)
    save_file(
        {"d2t": torch.tensor(d2t, dtype=torch.int64), "t2d": torch.tensor(t2d, dtype=torch.bool), "draft_ids": torch.tensor(draft_ids, dtype=torch.int64)},
        str(tmp / "draft_vocab.safetensors"),
    )
    covered = sum(counts[t] for t in draft_ids)
    shards = []
    per = config.prepare.shard_samples
    for s in range(0, len(samples), per):
        chunk = samples[s : s + per]
        offsets = [0]
        for ids, _ in chunk:
            offsets.append(offsets[-1] + len(ids))
        name = f"shard-{s // per:05d}.safetensors"
        save_file(
            {
                "input_ids": torch.tensor([t for ids, _ in chunk for t in ids], dtype=torch.int32),
                "loss_mask": torch.tensor([m for _, mask in chunk for m in mask], dtype=torch.uint8),
                "offsets": torch.tensor(offsets, dtype=torch.int64),
            },
            str(tmp / name),
        )
        shards.append({"file": name, "samples": len(chunk), "tokens": offsets[-1]})
    with open(tmp / "eval.jsonl", "w", encoding="utf-8") as f:
        for row in held_out:
            f.write(json.dumps({"id": row["id"], "dataset": row["dataset"], "messages": row["messages"][:-1]}, ensure_ascii=False) + "\n")
    total_assistant = sum(counts.values())
    index = {
        "fingerprint": fingerprint,
        "samples": len(samples),
        "tokens": sum(s["tokens"] for s in shards),
        "assistant_tokens": total_assistant,
        "duplicates_dropped": duplicates,
        "truncated": int(truncated),
        "held_out": len(held_out),
        "max_length": config.prepare.max_length,
        "vocab_size": vocab_size,
        "draft_vocab_size": len(draft_ids),
        "draft_vocab_coverage": round(covered / total_assistant, 6) if total_assistant else 0.0,
        "tokenizer": str(config.target.tokenizer_path),
        "shards": shards,
    }
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    ctx.metrics(samples=index["samples"], tokens=index["tokens"], duplicates_dropped=duplicates, draft_vocab_coverage=index["draft_vocab_coverage"])
    ctx.log("info", f"prepare: {index['samples']} samples, {index['tokens']} tokens, draft vocab {len(draft_ids)} covers {100 * index['draft_vocab_coverage']:.1f}% of assistant tokens")
    return index


def load_prepared(directory: Path) -> tuple[dict[str, Any], list[tuple[Any, Any]]]:
    """index and [(input_ids, loss_mask)] tensors of every prepared sample, in order."""
    from safetensors.torch import load_file

    index = json.loads((directory / "index.json").read_text())
    samples = []
    for shard in index["shards"]:
        tensors = load_file(str(directory / shard["file"]))
        offsets = tensors["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:]):
            samples.append((tensors["input_ids"][a:b], tensors["loss_mask"][a:b]))
    return index, samples
