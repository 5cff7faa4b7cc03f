"""Retries, and permanent failures past a dataset's first few, are counted, not logged one by
one: at a 2% fault rate one line per retry was most of the log, and a dataset whose rows all
fail wrote an ERROR line a second, pushing everything else out of view. Every interval, one
line says how many there were, in which datasets, of which kinds, on which endpoints, and names
a few prompts; every failure is still in the dataset's ``failures.jsonl`` and ``eagleops detail``."""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Callable

__all__ = ["CURRENT_REQUEST", "FailureDigest", "RetryDigest"]

# (dataset, prompt id) of the request a task is making; set by the dataset runner in each request task
CURRENT_REQUEST: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("eagleops_request", default=None)
_EXAMPLES = 3
_KIND_WIDTH = 40


def reason_kind(reason: str) -> str:
    """``HTTP 503: {...}`` -> ``HTTP 503``; ``connection error: ...`` -> ``connection error``."""
    if reason.startswith("HTTP "):
        return reason.split(":", 1)[0]
    for prefix, kind in (("timed out", "timeout"), ("connection error", "connection error"), ("malformed", "malformed reply")):
        if reason.startswith(prefix):
            return kind
    return _cut(reason.split(":", 1)[0], _KIND_WIDTH)


def _cut(text: str, width: int) -> str:
    """At most ``width`` characters, cut between words (a number cut mid-digit reads as another)."""
    if len(text) <= width:
        return text
    head = text[: width - 3]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + "..."


class RetryDigest:
    LEVEL = "warning"
    NOUNS = ("retry", "retries")

    def __init__(self, log: Callable[[str, str, str | None], None], interval_s: float = 5.0):
        self.log, self.interval_s = log, interval_s
        self._kinds: Counter[tuple[str, str]] = Counter()  # (kind, endpoint)
        self._datasets: Counter[str] = Counter()
        self._examples: list[str] = []

    def note(self, endpoint: str, reason: str) -> None:
        dataset, prompt_id = CURRENT_REQUEST.get() or (None, None)
        self._kinds[(reason_kind(reason), endpoint)] += 1
        if dataset is not None:
            self._datasets[dataset] += 1
        if prompt_id is not None and len(self._examples) < _EXAMPLES and prompt_id not in self._examples:
            self._examples.append(prompt_id)

    def flush(self) -> None:
        """One line for the interval, whatever the number of datasets: acknowledgements stay in view."""
        total = sum(self._kinds.values())
        if not total:
            return
        endpoints = {endpoint for _, endpoint in self._kinds}
        if len(endpoints) == 1:
            endpoint = endpoints.pop()
            what = ", ".join(f"{kind} x{n}" for (kind, _), n in self._kinds.most_common()) + (f" from {endpoint}" if endpoint else "")
        else:
            what = ", ".join(f"{kind} from {endpoint} x{n}" for (kind, endpoint), n in self._kinds.most_common())
        datasets = ", ".join(f"{name} {n}" for name, n in self._datasets.most_common())
        only = next(iter(self._datasets)) if len(self._datasets) == 1 else None
        examples = f"; e.g. {', '.join(self._examples)}" if self._examples else ""
        noun = self.NOUNS[total != 1]
        self.log(self.LEVEL, f"{total} {noun} in {self.interval_s:g}s ({datasets}): {what}{examples}", only)
        self._kinds.clear()
        self._datasets.clear()
        self._examples.clear()

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.flush()
        finally:
            self.flush()  # the last interval's, as the run ends


class FailureDigest(RetryDigest):
    """Rows that failed for good, once a dataset has logged its first ``SHOWN`` one by one."""

    LEVEL = "error"
    NOUNS = ("more permanent failure", "more permanent failures")
    SHOWN = 3  # per dataset, each on a line of its own, whole

    def __init__(self, log: Callable[[str, str, str | None], None], interval_s: float = 5.0):
        super().__init__(log, interval_s)
        self._shown: Counter[str] = Counter()

    def should_log_alone(self, dataset: str) -> bool:
        """Whether this dataset's next failure gets a line of its own (its first few do)."""
        self._shown[dataset] += 1
        return self._shown[dataset] <= self.SHOWN

    def failed(self, dataset: str, where: str, reason: str) -> None:
        """A row failed for good: a line of its own among the dataset's first few, else counted."""
        if self.should_log_alone(dataset):
            self.log(self.LEVEL, f"{where}: {reason}", dataset)
        else:
            self.note_failure(dataset, where, reason)

    def note_failure(self, dataset: str, prompt: str, reason: str) -> None:
        self._kinds[(reason_kind(reason), "")] += 1
        self._datasets[dataset] += 1
        if len(self._examples) < _EXAMPLES and prompt not in self._examples:
            self._examples.append(prompt)
