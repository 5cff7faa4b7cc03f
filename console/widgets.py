"""The console's panes. Each renders from ConsoleState on the app's tick and repaints only what
changed: table cells are diffed by key, text panes compare their text before updating."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from pipeline.engine import STAGES
from pipeline.events import DatasetProgress, StageStatus
from pipeline.report import dataset_cells, format_bytes, format_duration, format_rate, sparkline

from .state import ConsoleState

__all__ = ["DatasetsTable", "GpuPane", "ServerPane", "StagesPane"]

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
    ("eta", "ETA", 7),
    ("in_flight", "In flight", 9),
    ("failures", "Failed", 6),
)

_RIGHT = {"tokens", "percent", "samples", "avg", "req_s", "tok_s", "eta", "in_flight", "failures"}
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

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("home", "cursor(-1000)", show=False),
        Binding("end", "cursor(1000)", show=False),
    ]
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

    def on_click(self, event) -> None:
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
        segments = list(line.render(self.app.console))
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
            values = [Text(cells[k], style=_STATE_STYLE.get(cells[k], "") if k == "state" else ("green" if k == "bar" else "")) for k, _, _ in COLUMNS]
            strip = self._line(values, width, style)
            self._strips = {k: v for k, v in self._strips.items() if k[0] != name or k[1] != selected}
            self._strips[key] = strip
        return strip

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()


class _TextPane(Widget):
    """A pane of plain text whose size is fixed by CSS: a change repaints it without a layout
    pass (Static.update would re-lay-out the whole screen)."""

    def __init__(self, title: str, **kwargs):
        super().__init__(**kwargs)
        self.border_title = title
        self._text = ""

    def render(self) -> Text:
        return Text(self._text, no_wrap=True, overflow="ellipsis")

    def show_text(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self.refresh()


def _pct(value: float | None) -> str:
    return "N/A" if value is None else f"{value:.0f}%"


class GpuPane(_TextPane):
    def __init__(self, **kwargs):
        super().__init__("GPU", **kwargs)

    def render_state(self, state: ConsoleState, width: int = 24) -> None:
        lines = []
        gpu = state.gpu
        if gpu is None:
            lines.append("waiting for telemetry ...")
        elif not gpu.gpus:
            lines.append(gpu.error or "no NVIDIA GPU")
        else:
            for index, name, util, used, total, temp, power in gpu.gpus:
                temp_s = "N/A" if temp is None else f"{temp:.0f}°C"
                power_s = "N/A" if power is None else f"{power:.0f} W"
                lines.append(f"{index} {name[:22]}")
                lines.append(f"  util {_pct(util):>4}  {temp_s}  {power_s}")
                lines.append(f"  mem {format_bytes(used)} / {format_bytes(total)}")
                lines.append("  " + sparkline(list(state.gpu_history.get(index, [])), width, ceiling=100.0))
        if state.host is not None:
            host = state.host
            lines.append(f"host cpu {host.cpu_percent:.0f}%")
            lines.append(f"  ram {format_bytes(host.mem_used)} / {format_bytes(host.mem_total)}")
        self.show_text("\n".join(lines))


class ServerPane(_TextPane):
    def __init__(self, **kwargs):
        super().__init__("Server", **kwargs)

    def render_state(self, state: ConsoleState, width: int = 40) -> None:
        lines = []
        for url, ep in state.endpoints.items():
            p50 = "-" if ep.latency_p50_s is None else f"{ep.latency_p50_s:.2f}s"
            p95 = "-" if ep.latency_p95_s is None else f"{ep.latency_p95_s:.2f}s"
            lines.append(url)
            lines.append(f"  client: {format_rate(ep.tok_per_s)} tok/s  {format_rate(ep.req_per_s)} req/s  p50 {p50}  p95 {p95}  in flight {ep.in_flight}  errors {ep.errors}")
            server = state.servers.get(url)
            if server is not None and server.software != "none":
                parts = [f"  {server.software}:"]
                if server.gen_tok_per_s is not None:
                    parts.append(f"gen {format_rate(server.gen_tok_per_s)} tok/s")
                if server.running is not None:
                    parts.append(f"running {server.running:.0f}")
                if server.waiting is not None:
                    parts.append(f"queued {server.waiting:.0f}")
                if server.kv_usage is not None:
                    parts.append(f"KV {100 * server.kv_usage:.0f}%")
                if server.accept_length is not None:
                    parts.append(f"accept {server.accept_length:.2f}")
                lines.append(" ".join(parts))
        if not lines:
            lines.append("no requests yet")
        history = list(state.throughput)
        if history:
            lines.append(f"tok/s, last {len(history)}s (max {format_rate(max(history))})")
            lines.append(sparkline(history, width))
        self.show_text("\n".join(lines))


_STAGE_MARK = {
    StageStatus.PENDING: "·",
    StageStatus.RUNNING: "▶",
    StageStatus.PAUSED: "‖",
    StageStatus.DONE: "✓",
    StageStatus.KILLED: "✗",
    StageStatus.FAILED: "✗",
}


class StagesPane(_TextPane):
    def __init__(self, **kwargs):
        super().__init__("Stages", **kwargs)

    def render_state(self, state: ConsoleState, width: int = 30) -> None:
        lines = []
        for name in STAGES:
            stage = state.stages.get(name)
            status = stage.status if stage else StageStatus.PENDING
            line = f"{_STAGE_MARK[status]} {name:<9} {status.value:<8}"
            progress = state.stage_progress.get(name)
            if progress is not None and progress.total and status in (StageStatus.RUNNING, StageStatus.PAUSED):
                line += f" {100 * progress.done / progress.total:5.1f}% ETA {format_duration(progress.eta_s)}"
            lines.append(line)
        train = state.stage_metrics.get("train", {})
        if "loss" in train:
            acc = train.get("acc") or []
            lines.append(f"train step {train.get('step', '?')} loss {train['loss']:.3f}" + (f" acc {acc[0]:.2f}" if acc else ""))
            lines.append(sparkline(list(state.train_loss), width))
        evaluation = state.stage_metrics.get("eval", {})
        if "acceptance_length" in evaluation:
            lines.append(f"acceptance length {evaluation['acceptance_length']:.2f}")
        self.show_text("\n".join(lines))
