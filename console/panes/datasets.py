"""The datasets table: one row per dataset, painted line by line."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.events import Click
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from eagleops.console.report import dataset_cells, totals_cells
from eagleops.pipeline.protocol.events import DatasetProgress

from ..keymap import DATASET_KEYS, bindings
from ..terminal import to_ascii

__all__ = ["COLUMNS", "PRIORITY", "DatasetsTable", "layout"]

COLUMNS = (  # key, header, the most a cell may need (a longer dataset name is cut, never a number)
    ("dataset", "Dataset", 24),
    ("state", "State", 15),
    ("bar", "Budget", 16),
    ("tokens", "Tokens", 15),
    ("percent", "%", 6),
    ("samples", "Samples", 15),
    ("avg", "Avg len", 7),
    ("req_s", "req/s", 6),
    ("tok_s", "tok/s", 7),
    ("reasoning", "Think", 5),
    ("eta", "ETA", 7),
    ("in_flight", "In flight", 9),
    ("failures", "Failed", 7),
)
# which columns a narrow terminal keeps, first to last (80 columns keep the first seven)
PRIORITY = ("dataset", "state", "tokens", "percent", "tok_s", "eta", "samples", "failures", "in_flight", "req_s", "bar", "avg", "reasoning")
_GAP = 2
_STATE_ORDER = {"running": 0, "paused": 1, "queued": 2, "failed": 3, "killed": 4, "done": 5}
SORTS = ("source order", "progress", "tok/s", "failures", "state")
_SORT_KEYS = {
    "progress": lambda p: -p.fraction,
    "tok/s": lambda p: -p.tok_per_s,
    "failures": lambda p: -(p.failures + p.bad_lines),
    "state": lambda p: _STATE_ORDER.get(p.state.value, 9),
}

_RIGHT = {"tokens", "percent", "samples", "avg", "req_s", "tok_s", "reasoning", "eta", "in_flight", "failures"}
_CURSOR = Style(reverse=True, bold=True)

_STATE_STYLE = {
    "running": "green",  # the normal state: quiet, so that trouble stands out
    "paused": "bold yellow",
    "done": "green",
    "killed": "bold red",
    "failed": "bold red",
    "queued": "dim",
    "stale": "dim",
    "finishing": "yellow",  # the budget reached (or lowered below what is done): what is in flight finishes
}


# a dataset's failed rows as a share of the rows it finished: a note, then a warning, then trouble
FAILURE_SHARE_WARN, FAILURE_SHARE_ALARM = 0.01, 0.10


def failure_level(p: DatasetProgress) -> str:
    failed = p.failures + p.bad_lines
    share = failed / (failed + p.samples) if failed else 0.0
    return "alarm" if share >= FAILURE_SHARE_ALARM else "warn" if share >= FAILURE_SHARE_WARN else ""


_FAILURE_STYLE = {"alarm": "bold red", "warn": "yellow", "": ""}


def _state_style(state: str) -> str:
    return _STATE_STYLE.get(state.split(" ", 1)[0], "")


_NAME_LEAST = 8  # a dataset name gives up width down to this before a column it showed goes


def layout(widths: dict[str, int], available: int, keep: frozenset[str] = frozenset()) -> list[tuple[str, str, int]]:
    """The columns that fit in ``available`` cells, by priority, shown in their usual order.
    Below 100 columns a long dataset name gives up width (it is cut with ~) before a column goes;
    ``keep``: columns already on screen at this width, which stay while the numbers grow (the
    name gives up width for them, down to ``_NAME_LEAST``), rather than vanish mid-run."""
    widths = {**widths, "dataset": min(widths["dataset"], 16 if available < 100 else 24)}
    chosen: set[str] = set()
    used = 0
    for key in PRIORITY:
        need = widths[key] + (_GAP if chosen else 0)
        if used + need <= available:
            chosen.add(key)
            used += need
    for key in PRIORITY:
        if key in keep and key not in chosen:
            over = used + widths[key] + _GAP - available
            if over > widths["dataset"] - _NAME_LEAST:
                continue
            widths["dataset"] -= max(0, over)
            used += widths[key] + _GAP - max(0, over)
            chosen.add(key)
    return [(key, label, widths[key]) for key, label, _ in COLUMNS if key in chosen]


class DatasetsTable(Widget, can_focus=True):
    """One row per dataset, keyed by name, painted line by line (Textual's line API), with a
    totals row at the bottom; the rows scroll to keep the cursor in view.

    A row is turned into segments only when one of its cells, the layout or the cursor moved,
    so a tick in which three numbers changed costs three rows, not the whole table.
    Columns are as wide as their widest cell so far (never narrower: no jitter), and when the
    terminal is narrow the lowest-priority columns go, never a part of a number.
    """

    BINDINGS = bindings(DATASET_KEYS)
    cursor = reactive(0)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._cells: dict[str, dict[str, str]] = {}
        self._totals: dict[str, str] = {}
        self._widths = {key: len(label) for key, label, _ in COLUMNS}
        self._strips: dict[tuple, Strip] = {}
        self._top = 0  # the first dataset row shown
        self._progress: dict[str, DatasetProgress] = {}
        self._order: list[str] = []  # names as shown: source order, or sorted
        self.sort = SORTS[0]
        self._kept: tuple[int, frozenset[str]] = (0, frozenset())  # (at this width, the columns shown so far)

    @property
    def row_count(self) -> int:
        return len(self._cells)

    @property
    def names(self) -> list[str]:
        return self._order

    def next_sort(self) -> str:
        """Sort by the next key; the cursor stays on the dataset it was on."""
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self._reorder()
        return self.sort

    def _reorder(self, *, repaint: bool = True) -> None:
        selected = self.selected
        names = list(self._cells)
        if self.sort != "source order":
            names.sort(key=lambda n: _SORT_KEYS[self.sort](self._progress[n]))
        self._order = names
        if selected is not None and selected in names:
            self.cursor = names.index(selected)
        self._retitle()
        if repaint:
            self.refresh()

    @property
    def selected(self) -> str | None:
        names = self.names
        return names[min(self.cursor, len(names) - 1)] if names else None

    def cell(self, name: str, key: str) -> str:
        return self._cells[name][key]

    @property
    def visible_rows(self) -> int:
        return max(1, self.size.height - 2)  # less the header and the totals

    def action_cursor(self, step: int) -> None:
        if self._cells:
            self.cursor = max(0, min(len(self._cells) - 1, self.cursor + step))

    def _retitle(self) -> None:
        """Datasets, how many of them are in view when not all are, and the sort order."""
        total, rows = len(self._cells), self.visible_rows
        shown = f" {self._top + 1}-{min(total, self._top + rows)} of {total}" if 0 < rows < total else f" ({total})" if total else ""
        title = f"Datasets{shown}" + (f", by {self.sort}" if self.sort != SORTS[0] else "")
        if title != self.border_title:
            self.border_title = title

    def watch_cursor(self, cursor: int) -> None:
        rows = self.visible_rows
        if cursor < self._top:
            self._top = cursor
        elif cursor >= self._top + rows:
            self._top = cursor - rows + 1
        self._retitle()
        self.refresh()

    def on_resize(self) -> None:
        self.watch_cursor(self.cursor)

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        row = self._top + offset.y - 1
        if offset.y >= 1 and 0 <= row < len(self._cells) and offset.y < self.size.height - 1:
            self.cursor = row

    def show(self, datasets: dict[str, DatasetProgress], *, stale: bool = False) -> None:
        """``stale``: the engine went without a last word; a dataset it left running shows no
        rates, ETA or requests in flight, only what it had done. Repaints the rows that changed
        (and the totals); the whole table only when the order, a column's width or the set of
        datasets moved."""
        changed: list[str] = []
        known = len(self._cells)
        for name, progress in datasets.items():
            self._progress[name] = progress
            cells = dataset_cells(progress) | {"failure_level": failure_level(progress)}
            if stale and not progress.state.terminal:
                cells |= {"state": "stale", "req_s": "-", "tok_s": "-", "eta": "-", "in_flight": "-"}
            if self._cells.get(name) != cells:
                self._cells[name] = cells
                changed.append(name)
        if not changed:
            return
        self._totals = totals_cells(list(datasets.values()))
        if stale:
            self._totals |= {"req_s": "-", "tok_s": "-", "eta": "-", "in_flight": "-"}
        widths = dict(self._widths)
        for cells in (*self._cells.values(), self._totals):
            for key, _, most in COLUMNS:
                self._widths[key] = max(self._widths[key], min(most, len(cells.get(key, ""))))
        order = list(self._order)
        self._reorder(repaint=False)
        if widths != self._widths or order != self._order or known != len(self._cells) or not self.size.width:
            self.refresh()
            return
        rows = [self._order.index(name) - self._top + 1 for name in changed]  # +1: the header line
        lines = [y for y in rows if 1 <= y < self.size.height - 1] + [self.size.height - 1]  # and the totals
        self.refresh(*(Region(0, y, self.size.width, 1) for y in lines))

    # ---- painting -------------------------------------------------------------------------
    def _columns(self) -> list[tuple[str, str, int]]:
        width = self.size.width
        if self._kept[0] != width:  # a resize chooses afresh
            self._kept = (width, frozenset())
        columns = layout(self._widths, width, self._kept[1])
        if self._cells:  # an empty table's header-wide columns were never really shown
            self._kept = (width, self._kept[1] | {key for key, _, _ in columns})
        return columns

    def _line(self, columns: list[tuple[str, str, int]], values: dict[str, Text], width: int, style: Style) -> Strip:
        line = Text(no_wrap=True, overflow="crop", style=style)
        for i, (key, _, col_width) in enumerate(columns):
            value = values[key]
            if value.cell_len > col_width:  # only names get here: numbers are never wider than their column
                value.truncate(col_width - 1)
                value.append("~")
            if key in _RIGHT:
                value.pad_left(col_width - value.cell_len)
            else:
                value.pad_right(col_width - value.cell_len)
            if i:
                line.append(" " * _GAP)
            line.append_text(value)
        # every segment styled: Textual's NO_COLOR filter reads each segment's style and would
        # crash on the bare ones Rich emits for padding
        segments = [Segment(text, style or Style.null(), control) for text, style, control in line.render(self.app.console)]
        return Strip(segments).crop_extend(0, width, style)

    def _row_values(self, cells: dict[str, str]) -> dict[str, Text]:
        if getattr(self.app, "ascii", False):
            cells = {k: to_ascii(v) for k, v in cells.items()}
        styles = {"state": _state_style(cells.get("state", "")), "bar": "green", "failures": _FAILURE_STYLE[cells.get("failure_level", "")]}
        return {k: Text(cells.get(k, ""), style=styles.get(k, "")) for k, _, _ in COLUMNS}

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        columns = self._columns()
        shape = (width, tuple(c[2] for c in columns))
        if y == 0:
            return self._cached(
                ("header", shape), lambda: self._line(columns, {k: Text(label) for k, label, _ in COLUMNS}, width, base + Style(bold=True))
            )
        if y == self.size.height - 1 and self._cells:
            totals = self._totals
            return self._cached(
                ("totals", shape, tuple(totals.values())),
                lambda: self._line(columns, self._row_values(totals), width, base + Style(bold=True)),
            )
        row = self._top + y - 1
        names = self.names
        if row >= len(names):
            return Strip.blank(width, base)
        name = names[row]
        selected = row == self.cursor and self.has_focus
        cells = self._cells[name]
        style = base + _CURSOR if selected else base
        return self._cached(
            (name, selected, shape, tuple(cells.values())), lambda: self._line(columns, self._row_values(cells), width, style)
        )

    def _cached(self, key: tuple, paint) -> Strip:
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) > 4 * (len(self._cells) + 2):
                self._strips.clear()  # old widths, old numbers: painted again on demand
            strip = self._strips[key] = paint()
        return strip

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
