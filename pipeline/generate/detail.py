"""One dataset in detail, on request: what a person asks when a row looks wrong. Why did records
fail (all of failed.jsonl, not only this session's), how slow are replies, which endpoints served
it, how many replies were cut at max_tokens."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleops.pipeline.generate.digest import reason_kind

if TYPE_CHECKING:
    from eagleops.pipeline.generate.runner import DatasetRunner

__all__ = ["dataset_detail", "failure_reasons"]

_READ_AT_MOST = 64 << 20  # of failed.jsonl; a bigger one is summarised from its last 64 MiB


def failure_reasons(path: Path) -> tuple[dict[str, int], bool]:
    """Failures by kind (``bad line: prompt``, ``HTTP 500``...), and whether the file was only partly read.
    Blocking: call through a thread."""
    kinds: Counter[str] = Counter()
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - _READ_AT_MOST))
            if size > _READ_AT_MOST:
                f.readline()  # the first line read is a partial one
            for raw in f:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("kind") == "bad_line":
                    kinds[f"bad line: {record.get('field', '?')}"] += 1
                elif record.get("kind") == "skipped":  # not a failure: counted apart (``skipped``)
                    continue
                else:
                    kinds[reason_kind(str(record.get("reason", "")))] += 1
    except FileNotFoundError:
        return {}, False
    return dict(kinds.most_common()), size > _READ_AT_MOST


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3)


def dataset_detail(runner: DatasetRunner) -> dict[str, Any]:
    """The live part, read on the event loop (the runner's state is the loop's alone); the
    failures come from ``failure_reasons`` in a thread."""
    progress = runner.progress()
    totals = runner.store.accepted
    latencies = list(runner.latencies)
    return {
        "name": runner.config.name,
        "state": progress.state.value,
        "reason": progress.reason,
        "source": str(runner.config.path),
        "output": str(runner.store.directory),
        "tokens": totals.tokens,
        "budget": runner.budget,
        "samples": totals.samples,
        "truncated": totals.truncated,
        "skipped": totals.skipped,
        "reasoning_tokens": totals.reasoning_tokens,
        "prompt_tokens": totals.prompt_tokens,
        "cost": round(totals.cost, 6),
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p95_s": _percentile(latencies, 0.95),
        "latency_samples": len(latencies),
        "endpoints": dict(runner.endpoint_counts.most_common()),
        "storage_error": runner.storage_error,
    }
