"""The console's log: filtered by level and dataset, searched, newest line in view."""

from __future__ import annotations

import re
import time
from collections import deque
from typing import NamedTuple

from rich.highlighter import Highlighter
from rich.text import Text
from textual.widgets import Log

__all__ = ["LEVELS", "LogView"]

LEVELS = ("all", "warning", "error")  # what the level filter cycles through: at least this severe
_RANK = {"debug": 0, "info": 1, "warning": 2, "error": 3}
KEPT = 5000
_STAMPED = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+) *")
_LEVEL_STYLE = {"ERROR": ("bold red", "red"), "WARNING": ("bold yellow", ""), "INFO": ("dim", ""), "DEBUG": ("dim", "dim")}


class LevelHighlighter(Highlighter):
    """Colour by severity: an error line red, its level word bold; a warning's level word
    yellow; info quiet. The level is read from the line's own stamp (``HH:MM:SS LEVEL``)."""

    def highlight(self, text: Text) -> None:
        stamped = _STAMPED.match(text.plain)
        if stamped is None:
            return
        word, line = _LEVEL_STYLE.get(stamped["level"], ("", ""))
        if line:
            text.stylize(line, stamped.end())
        if word:
            text.stylize(word, stamped.start("level"), stamped.end("level"))


def stamped(line: str, level: str, at: float | None = None) -> str:
    """The line as the log shows it: with the clock and the level in front, as the engine's are."""
    if _STAMPED.match(line):
        return line
    return f"{time.strftime('%H:%M:%S', time.localtime(at))} {level.upper():<7} {line}"


class _Entry(NamedTuple):
    line: str
    level: str
    dataset: str | None


class LogView(Log):
    """Every line is kept (up to KEPT); a filter change repaints the matching ones."""

    def __init__(self, **kwargs):
        super().__init__(max_lines=KEPT, auto_scroll=False, highlight=True, **kwargs)  # it follows by itself: see add()
        self.highlighter = LevelHighlighter()
        self.entries: deque[_Entry] = deque(maxlen=KEPT)
        self.level = "all"
        self.following = True  # the newest line in view; off while the operator reads back (PgUp)
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
        entry = _Entry(stamped(line, level), level, dataset)
        self.entries.append(entry)
        if self._matches(entry):
            # Log's own auto-scroll follows only when the view is already at the end, which it is
            # not after the lines an attached console gets at once (written before its layout)
            self.write_line(entry.line, scroll_end=False)
            if self.following:
                self.scroll_end(animate=False, x_axis=False)

    def shown_lines(self) -> list[str]:
        """Every kept line the filter shows, whole."""
        return [e.line for e in self.entries if self._matches(e)]

    def refilter(self, *, level: str | None = None, dataset: str | None | bool = False, search: str | None = None) -> None:
        """Change the filter (``dataset=None`` clears it; False leaves it) and show what matches."""
        if level is not None:
            self.level = level
        if dataset is not False:
            self.dataset = dataset if isinstance(dataset, str) else None
        if search is not None:
            self.search = search
        self.clear()
        self.following = True  # a new filter shows its newest lines
        self.write_lines([e.line for e in self.entries if self._matches(e)], scroll_end=False)
        self.scroll_end(animate=False, x_axis=False)
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

    def page(self, pages: int) -> None:
        """Scroll by pages; reading back stops the following, reaching the end starts it again."""
        self.scroll_to(y=self.scroll_y + pages * max(1, self.scrollable_content_region.height - 1), animate=False)
        self.following = self.scroll_y + pages * max(1, self.scrollable_content_region.height - 1) >= self.max_scroll_y

    def on_resize(self) -> None:
        if self.following:
            self.scroll_end(animate=False)
