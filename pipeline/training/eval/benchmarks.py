"""Benchmarks for eval: published sets read in their own formats (MT-Bench, GSM8K, HumanEval,
MATH500) or any source through a field map, each question asked turn by turn with the target's
own earlier answers in the history, and the per-benchmark table every output shows.

The prompt text of each published set is SpecForge's harness's (``config.fields.BENCHMARKS``),
so an acceptance length here compares with the figures drafters are published with; the chat
template is the target's own, with the run's thinking mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.config.fields import BENCHMARKS, BenchmarkConfig, field_map
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.sources import BadLine, Prompt, Source, SourceReader
from eagleops.pipeline.training.artifacts import EvalResult

__all__ = ["BenchmarkItem", "Decode", "Work", "ask_turns", "benchmark_table", "load_benchmark", "write_benchmarks"]

Decode = Callable[[list[int]], list[int]]  # one prompt's ids -> the ids generated
Work = tuple[str, int, Callable[[Decode], list[list[int]]]]  # (benchmark, questions, decode them all with a Decode)


@dataclass(frozen=True)
class BenchmarkItem:
    id: str
    system: str | None
    turns: tuple[str, ...]  # user turns, asked in order


def _published(bench: BenchmarkConfig, limit: int) -> list[BenchmarkItem]:
    spec = BENCHMARKS[bench.format]
    items: list[BenchmarkItem] = []
    source = Source(bench.path, bench.split)
    for index, row in source.rows():
        where = f"{source.label(index)}:{row.number}"
        if row.error is not None or not isinstance(row.value, dict):
            raise InputError(f"{where}: {row.error or 'expected an object'}")
        value = row.value.get(spec.turns)
        turns = value if isinstance(value, list) else [value]
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise InputError(
                f"{where}: {spec.turns}: missing or not text ({bench.format} rows have it; this row has: {', '.join(sorted(row.value))})"
            )
        own_id = row.value.get(spec.id, f"{bench.name}:{len(items)}")
        items.append(BenchmarkItem(str(own_id), bench.system, tuple(spec.wrapper.format(t) for t in turns)))
        if len(items) >= limit:
            break
    return items


def _mapped(bench: BenchmarkConfig, limit: int) -> list[BenchmarkItem]:
    """Any source through a field map: its user turns in order; its system prompt, else ours."""
    items: list[BenchmarkItem] = []
    fields = field_map(bench.format, bench.fields)
    for item in SourceReader(Source(bench.path, bench.split), fields, regenerate="all"):
        if isinstance(item, BadLine):
            raise InputError(item.message)
        if not isinstance(item, Prompt):
            continue
        system = next((m["content"] for m in item.messages if m["role"] == "system"), bench.system)
        turns = tuple(m["content"] for m in item.messages if m["role"] == "user")
        items.append(BenchmarkItem(item.prompt_id, system, turns))
        if len(items) >= limit:
            break
    return items


def load_benchmark(bench: BenchmarkConfig, default_limit: int) -> list[BenchmarkItem]:
    limit = bench.prompts or default_limit
    items = _published(bench, limit) if bench.format in BENCHMARKS else _mapped(bench, limit)
    if not items:
        raise InputError(f"{bench.path}: benchmark {bench.name!r} has no questions")
    return items


def ask_turns(
    items: Sequence[BenchmarkItem],
    tokenizer: Any,
    template: dict[str, Any],
    generate: Callable[[list[int]], list[int]],
    on_item: Callable[[int], None] = lambda done: None,
) -> list[list[int]]:
    """Every item's turns in order, each after the target's own earlier answers; ``generate``
    decodes one prompt's ids. Returns each turn's generated ids, item by item."""
    outputs: list[list[int]] = []
    for done, item in enumerate(items, 1):
        messages: list[dict[str, Any]] = [{"role": "system", "content": item.system}] if item.system else []
        for turn in item.turns:
            messages.append({"role": "user", "content": turn})
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template)
            ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
            generated = generate(ids)
            outputs.append(generated)
            messages.append({"role": "assistant", "content": tokenizer.decode(generated, skip_special_tokens=True)})
        on_item(done)
    return outputs


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def benchmark_table(results: Sequence[EvalResult]) -> str:
    """One row per benchmark: questions (``n``), verify steps, acceptance length, the acceptance
    rate at each draft position, and where timed, tokens/s with the drafter, without it, and
    their ratio (with 4 draft tokens its rows fit the console's log at 80 columns)."""
    positions = max((len(r.acceptance_rate_per_position) for r in results), default=0)
    served = any(r.tok_per_s for r in results)
    header = ["benchmark", "n", "steps", "accept", *[f"p{j + 1}" for j in range(positions)]]
    rows = [header + (["tok/s", "plain", "speedup"] if served else [])]
    for r in results:
        rates = [_cell(x) for x in r.acceptance_rate_per_position] + ["-"] * (positions - len(r.acceptance_rate_per_position))
        row = [r.benchmark, str(r.prompts), str(r.verify_steps), _cell(r.acceptance_length), *rates]
        if served:
            speedup = r.tok_per_s / r.tok_per_s_without_drafter if r.tok_per_s and r.tok_per_s_without_drafter else None
            row += [_cell(r.tok_per_s, 1), _cell(r.tok_per_s_without_drafter, 1), _cell(speedup) + ("x" if speedup else "")]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def write_benchmarks(results: Sequence[EvalResult], *paths: Path) -> None:
    """The table as JSON (one object per benchmark), where the run keeps its eval and beside the drafter."""
    payload = json.dumps({"benchmarks": [r.to_json() for r in results]}, indent=1)
    for path in paths:
        if path.parent.is_dir():
            path.write_text(payload)
