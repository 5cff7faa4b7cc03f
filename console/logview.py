"""The console's log: filtered by level and dataset, searched, newest line in view."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from textual.widgets import Log

__all__ = ["LEVELS", "LogView"]

LEVELS = ("all", "warning", "error")  # what the level filter cycles through: at least this severe
_RANK = {"debug": 0, "info": 1, "warning": 2, "error": 3}
KEPT = 5000


class _Entry(NamedTuple):
    line: str
    level: str
    dataset: str | None


class LogView(Log):
    """Every line is kept (up to KEPT); a filter change repaints the matching ones."""

    def __init__(self, **kwargs):
        super().__init__(max_lines=KEPT, auto_scroll=True, **kwargs)
        self.entries: deque[_Entry] = deque(maxlen=KEPT)
        self.level = "all"
        self.dataset: str | None = None
        self.search = ""
        self._retitle()

    def _matches(self, entry: _Entry) -> bool:
        if self.level != "all" and _RANK.get(entry.level, 1) < _RANK[self.level]:
            return False
        if self.dataset is not None and entry.dataset not in (self.dataset, None):
            return False
        return not self.search or self.search.lower() in entry.line.lower()

    def add(self, line: str, level: str = "info", dataset: str | None = None) -> None:
        entry = _Entry(line, level, dataset)
        self.entries.append(entry)
        if self._matches(entry):
            self.write_line(line)

    def refilter(self, *, level: str | None = None, dataset: str | None | bool = False, search: str | None = None) -> None:
        """Change the filter (``dataset=None`` clears it; False leaves it) and show what matches."""
        if level is not None:
            self.level = level
        if dataset is not False:
            self.dataset = dataset if isinstance(dataset, str) else None
        if search is not None:
            self.search = search
        self.clear()
        self.write_lines([e.line for e in self.entries if self._matches(e)])
        self._retitle()

    def _retitle(self) -> None:
        parts = []
        if self.level != "all":
            parts.append(f"{self.level}s and worse" if self.level == "warning" else "errors")
        if self.dataset is not None:
            parts.append(self.dataset)
        if self.search:
            parts.append(f"/{self.search}/")
        self.border_title = "Log" + (f" ({', '.join(parts)})" if parts else "")
