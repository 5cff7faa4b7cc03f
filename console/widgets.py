"""The console's panes. Each renders from ConsoleState on the app's tick and repaints only what
changed: table cells are diffed by key, text panes compare their text before updating."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable, Static

from pipeline.engine import STAGES
from pipeline.events import DatasetProgress, StageStatus
from pipeline.report import dataset_cells, format_bytes, format_rate, sparkline

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

_STATE_STYLE = {
    "running": "bold green",
    "paused": "bold yellow",
    "done": "cyan",
    "over budget": "magenta",
    "killed": "bold red",
    "failed": "bold red",
    "queued": "dim",
}


class DatasetsTable(DataTable):
    """One row per dataset, keyed by name; only changed cells are written."""

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._shown: dict[str, dict[str, str]] = {}

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=width)

    @property
    def selected(self) -> str | None:
        if not self.row_count:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return row_key.value

    def show(self, datasets: dict[str, DatasetProgress]) -> None:
        for name, progress in datasets.items():
            cells = dataset_cells(progress)
            previous = self._shown.get(name)
            if previous is None:
                self.add_row(*(self._cell(key, cells[key]) for key, _, _ in COLUMNS), key=name)
            else:
                for key, _, _ in COLUMNS:
                    if previous[key] != cells[key]:
                        self.update_cell(name, key, self._cell(key, cells[key]), update_width=False)
            self._shown[name] = cells

    @staticmethod
    def _cell(key: str, value: str) -> Text | str:
        if key == "state":
            return Text(value, style=_STATE_STYLE.get(value, ""))
        if key == "bar":
            return Text(value, style="green")
        return Text(value, justify="right") if key not in ("dataset",) else value


class _TextPane(Static):
    def __init__(self, title: str, **kwargs):
        super().__init__("", **kwargs)
        self.border_title = title
        self._text = ""

    def show_text(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self.update(text)


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
                lines.append(f"  util {_pct(util):>4}  mem {format_bytes(used)} / {format_bytes(total)}  {temp_s}  {power_s}")
                lines.append("  " + sparkline(list(state.gpu_history.get(index, [])), width, ceiling=100.0))
        if state.host is not None:
            host = state.host
            lines.append(f"host cpu {host.cpu_percent:.0f}%  ram {format_bytes(host.mem_used)} / {format_bytes(host.mem_total)}")
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

    def render_state(self, state: ConsoleState) -> None:
        lines = []
        for name in STAGES:
            stage = state.stages.get(name)
            status = stage.status if stage else StageStatus.PENDING
            lines.append(f"{_STAGE_MARK[status]} {name:<9} {status.value}")
        self.show_text("\n".join(lines))
