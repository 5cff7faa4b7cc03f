"""GPUs of the engine's host (NVML, published by the engine) and its CPU and memory."""

from __future__ import annotations

from eagleops.console.report import format_bytes, sparkline

from ..state import ConsoleState
from .text import TextPane

__all__ = ["GpuPane"]


def _pct(value: float | None) -> str:
    return "N/A" if value is None else f"{value:.0f}%"


class GpuPane(TextPane):
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
