"""The datasets table: one row per dataset, painted line by line."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.events import Click
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from pipeline.protocol.events import DatasetProgress
from pipeline.protocol.report import dataset_cells

from ..keymap import DATASET_KEYS, bindings

__all__ = ["COLUMNS", "DatasetsTable"]

COLUMNS = (
    ("dataset", "Dataset", 10),
    ("state", "State", 11),
    ("bar", "Budget", 16),
    ("tokens", "Tokens", 13),
    ("percent", "%", 6),
    ("samples", "Samples", 9),
    ("avg", "Avg len", 7),
    ("req_s", "req/s", 6),
    ("tok_s", "tok/s", 7),
    ("reasoning", "Think", 5),
    ("eta", "ETA", 7),
    ("in_flight", "In flight", 9),
    ("failures", "Failed", 6),
)

_RIGHT = {"tokens", "percent", "samples", "avg", "req_s", "tok_s", "reasoning", "eta", "in_flight", "failures"}
_CURSOR = Style(reverse=True, bold=True)

_STATE_STYLE = {
    "running": "bold green",
    "paused": "bold yellow",
    "done": "cyan",
    "over budget": "magenta",
    "killed": "bold red",
    "failed": "bold red",
    "queued": "dim",
}


class DatasetsTable(Widget, can_focus=True):
    """One row per dataset, keyed by name, painted line by line (Textual's line API).

    A row is turned into segments only when one of its cells or the cursor moved, so a tick in
    which three numbers changed costs three rows, not the whole table (DataTable re-renders every
    cell on any update; at 1 Hz with 8 datasets that was most of the console's CPU).
    """

    BINDINGS = bindings(DATASET_KEYS)
    cursor = reactive(0)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._cells: dict[str, dict[str, str]] = {}
        self._strips: dict[tuple[str, bool, int], Strip] = {}
        self._header: tuple[int, Strip] | None = None

    @property
    def row_count(self) -> int:
        return len(self._cells)

    @property
    def names(self) -> list[str]:
        return list(self._cells)

    @property
    def selected(self) -> str | None:
        names = self.names
        return names[min(self.cursor, len(names) - 1)] if names else None

    def cell(self, name: str, key: str) -> str:
        return self._cells[name][key]

    def action_cursor(self, step: int) -> None:
        if self._cells:
            self.cursor = max(0, min(len(self._cells) - 1, self.cursor + step))

    def watch_cursor(self) -> None:
        self.refresh()

    def on_click(self, event: Click) -> None:
        row = event.y - 1
        if 0 <= row < len(self._cells):
            self.cursor = row

    def show(self, datasets: dict[str, DatasetProgress]) -> None:
        changed = False
        for name, progress in datasets.items():
            cells = dataset_cells(progress)
            if self._cells.get(name) != cells:
                self._cells[name] = cells
                changed = True
        if changed:
            self.refresh()

    # ---- painting -------------------------------------------------------------------------
    def _line(self, values: list[Text], width: int, style: Style) -> Strip:
        line = Text(no_wrap=True, overflow="ellipsis", style=style)
        for (key, _, col_width), value in zip(COLUMNS, values):
            value.truncate(col_width, overflow="ellipsis")
            if key in _RIGHT:
                value.pad_left(col_width - value.cell_len)
            else:
                value.pad_right(col_width - value.cell_len)
            line.append_text(value)
            line.append("  ")
        # every segment styled: Textual's NO_COLOR filter reads each segment's style and would
        # crash on the bare ones Rich emits for padding
        segments = [Segment(text, style or Style.null(), control) for text, style, control in line.render(self.app.console)]
        return Strip(segments).crop_extend(0, width, style)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        if y == 0:
            if self._header is None or self._header[0] != width:
                header_style = base + Style(bold=True)
                self._header = (width, self._line([Text(label) for _, label, _ in COLUMNS], width, header_style))
            return self._header[1]
        names = self.names
        row = y - 1
        if row >= len(names):
            return Strip.blank(width, base)
        name = names[row]
        selected = row == self.cursor and self.has_focus
        cells = self._cells[name]
        key = (name, selected, width, tuple(cells.values()))
        strip = self._strips.get(key)
        if strip is None:
            style = base + _CURSOR if selected else base
            values = [
                Text(cells[k], style=_STATE_STYLE.get(cells[k], "") if k == "state" else ("green" if k == "bar" else ""))
                for k, _, _ in COLUMNS
            ]
            strip = self._line(values, width, style)
            self._strips = {k: v for k, v in self._strips.items() if k[0] != name or k[1] != selected}
            self._strips[key] = strip
        return strip

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
