"""Retries are counted, not logged one by one: at a 2% fault rate one line per retry was most of
the log and pushed everything else out of view. Every interval, one line per dataset says how
many retries there were, of which kinds, on which endpoints, and names a few prompts."""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Callable

__all__ = ["CURRENT_REQUEST", "RetryDigest"]

# (dataset, prompt id) of the request a task is making; set by the dataset runner in each request task
CURRENT_REQUEST: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("eagleops_request", default=None)
_EXAMPLES = 3


def reason_kind(reason: str) -> str:
    """``HTTP 503: {...}`` -> ``HTTP 503``; ``connection error: ...`` -> ``connection error``."""
    if reason.startswith("HTTP "):
        return reason.split(":", 1)[0]
    for prefix, kind in (("timed out", "timeout"), ("connection error", "connection error"), ("malformed", "malformed reply")):
        if reason.startswith(prefix):
            return kind
    return reason.split(":", 1)[0][:40]


class RetryDigest:
    def __init__(self, log: Callable[[str, str, str | None], None], interval_s: float = 5.0):
        self.log, self.interval_s = log, interval_s
        self._kinds: dict[str | None, Counter[str]] = {}
        self._examples: dict[str | None, list[str]] = {}

    def note(self, endpoint: str, reason: str) -> None:
        dataset, prompt_id = CURRENT_REQUEST.get() or (None, None)
        self._kinds.setdefault(dataset, Counter())[f"{reason_kind(reason)} from {endpoint}"] += 1
        examples = self._examples.setdefault(dataset, [])
        if prompt_id is not None and len(examples) < _EXAMPLES and prompt_id not in examples:
            examples.append(prompt_id)

    def flush(self) -> None:
        for dataset, kinds in self._kinds.items():
            total = sum(kinds.values())
            what = ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common())
            examples = self._examples.get(dataset) or []
            prompts = f"; e.g. {', '.join(examples)}" if examples else ""
            where = f"{dataset}: " if dataset else ""
            self.log("warning", f"{where}{total} {'retry' if total == 1 else 'retries'} in {self.interval_s:g}s: {what}{prompts}", dataset)
        self._kinds.clear()
        self._examples.clear()

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.flush()
        finally:
            self.flush()  # the last interval's, as the run ends
