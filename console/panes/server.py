"""Each endpoint: client-side rates and latency, the server's own /metrics, a throughput plot."""

from __future__ import annotations

from eagleops.console.report import format_bytes, format_rate, sparkline

from ..state import ConsoleState
from .text import TextPane

__all__ = ["ServerPane"]


class ServerPane(TextPane):
    def __init__(self, **kwargs):
        super().__init__("Server", **kwargs)

    def render_state(self, state: ConsoleState, width: int = 40) -> None:
        lines = []
        if state.gpu is not None and not state.gpu.gpus and state.host is not None:  # no GPU pane: the host in one line here
            host = state.host
            lines.append(
                f"host: {state.gpu.error or 'no NVIDIA GPU'}, cpu {host.cpu_percent:.0f}%, ram {format_bytes(host.mem_used)}/{format_bytes(host.mem_total)}"
            )
        for url, ep in state.endpoints.items():
            p50 = "-" if ep.latency_p50_s is None else f"{ep.latency_p50_s:.2f}s"
            p95 = "-" if ep.latency_p95_s is None else f"{ep.latency_p95_s:.2f}s"
            lines.append(url)
            lines.append(
                f"  client: {format_rate(ep.tok_per_s)} tok/s  {format_rate(ep.req_per_s)} req/s  p50 {p50}  p95 {p95}  in flight {ep.in_flight}  errors {ep.errors}"
            )
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
