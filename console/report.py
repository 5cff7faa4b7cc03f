"""One formatter for every output: the ``--no-tui`` log lines, JSON lines, and the console's cells."""

from __future__ import annotations

import json
import time

from eagleops.pipeline.config import format_tokens
from eagleops.pipeline.protocol.events import (
    DatasetProgress,
    EndpointStats,
    Event,
    LogEvent,
    RunState,
    StageMetrics,
    StageProgress,
    StageState,
)

__all__ = [
    "STATUS_WIDTH",
    "dataset_cells",
    "detail_text",
    "format_bytes",
    "format_duration",
    "format_event",
    "format_rate",
    "join_fitting",
    "json_line",
    "plot",
    "progress_bar",
    "projected_cost",
    "projected_spend",
    "run_eta_s",
    "metrics_text",
    "sparkline",
    "stage_progress_line",
    "status_line",
    "totals_cells",
    "totals_line",
]


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{m:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def format_rate(value: float) -> str:
    """Three figures at most; a slow rate keeps two significant ones (a 20 s step is 0.05/s, not 0.0)."""
    if value >= 1000:
        return format_tokens(value)
    if 0 < value < 1:
        return f"{value:.2g}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


_BLOCKS = " ▏▎▍▌▋▊▉█"
_SPARK = "▁▂▃▄▅▆▇█"


def progress_bar(fraction: float, width: int = 16) -> str:
    """A fixed-width bar with eighth-block resolution (no animation, nothing to repaint)."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    bar = "█" * full + (_BLOCKS[part] if part else "")
    return bar.ljust(width, "·")[:width]


def sparkline(values: list[float], width: int, *, ceiling: float | None = None) -> str:
    """The last ``width`` values (averaged into buckets when there are more) as ▁..█."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        buckets = [values[int(i * step) : max(int(i * step) + 1, int((i + 1) * step))] for i in range(width)]
        values = [sum(b) / len(b) for b in buckets]
    top = ceiling if ceiling is not None else max(values)
    if top <= 0:
        return _SPARK[0] * len(values)
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in values)


def _buckets(values: list[float], width: int) -> list[float]:
    if len(values) <= width:
        return values
    step = len(values) / width
    return [sum(b) / len(b) for b in (values[int(i * step) : max(int(i * step) + 1, int((i + 1) * step))] for i in range(width))]


def plot(values: list[float], width: int, height: int) -> list[str]:
    """``values`` over the whole ``width`` (bucketed when there are more, each stretched over its
    share of the columns when there are fewer) as a bar plot ``height`` rows high, eighth-block
    resolution, scaled between their minimum and maximum (a loss curve's shape, not its zero);
    the top row first."""
    if not values or width < 1 or height < 1:
        return []
    values = _buckets(values, width) if len(values) > width else [values[c * len(values) // width] for c in range(width)]
    low, high = min(values), max(values)
    span = high - low
    levels = [height * 8 if span <= 0 else 1 + int((v - low) / span * (height * 8 - 1) + 0.5) for v in values]
    rows = []
    for row in range(height - 1, -1, -1):
        line = ""
        for level in levels:
            filled = level - row * 8
            line += "█" if filled >= 8 else (_SPARK[filled - 1] if filled > 0 else " ")
        rows.append(line.rstrip())
    return rows


def format_bytes(n: float | None) -> str:
    if n is None:
        return "N/A"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def projected_cost(p: DatasetProgress) -> float:
    """What the dataset will have cost when it stops: spent so far, plus, while it still runs,
    the tokens left to its budget at the price per token it has paid (0 for a free endpoint).
    A stopped dataset costs nothing more."""
    if p.state.terminal or not p.cost or not p.tokens:
        return p.cost
    return p.cost + p.cost / p.tokens * max(0, p.budget - p.tokens)


def projected_spend(progress: list[DatasetProgress]) -> float:
    """The run's spend when every dataset stops: each at its own price, never one average
    price over free and paid datasets alike."""
    return sum(projected_cost(p) for p in progress)


def dataset_cells(p: DatasetProgress) -> dict[str, str]:
    """The columns of a dataset row, by name; the TUI and the status line both use these."""
    state = p.state.value
    if p.state.value == "done" and p.overshoot:  # the normal end: the budget reached, a little past it
        state = f"done +{format_tokens(p.overshoot)}"
    elif p.state.value == "done" and p.stopped_by is not None and p.stopped_by.value == "source exhausted" and p.tokens < p.budget:
        state = "done (source)"  # every row answered before the budget: not a shortfall to hunt for in the log
    elif p.state.value == "running" and p.budget and p.tokens >= p.budget:  # it issues nothing more
        state = "finishing"
    # a stopped or paused dataset makes nothing: no rates, no ETA (its meter still holds the last seconds)
    stopped = p.state.terminal or p.state.value == "paused"
    return {
        "dataset": p.name,
        "state": state,
        "tokens": f"{format_tokens(p.tokens)}/{format_tokens(p.budget)}",
        "bar": progress_bar(p.fraction),
        "percent": f"{100 * p.fraction:.1f}%",
        "samples": f"{p.samples:,}" + (f"/{p.max_samples:,}" if p.max_samples else ""),
        "avg": f"{p.mean_completion:.0f}",
        "req_s": "-" if stopped else format_rate(p.req_per_s),
        "tok_s": "-" if stopped else format_rate(p.tok_per_s),
        "reasoning": f"{100 * p.reasoning_share:.0f}%" if p.reasoning_tokens else "-",
        "eta": "-" if stopped else format_duration(p.eta_s),
        "in_flight": "-" if p.state.terminal else str(p.in_flight),
        "failures": str(p.failures + p.bad_lines),
        "truncated": str(p.truncated),
        "cost": f"${p.cost:.2f}" if p.cost else "",
        # paid APIs: what it will have cost when it stops, at the price per token seen so far
        "projected_cost": f"${projected_cost(p):.2f}" if p.cost else "",
    }


STATUS_WIDTH = 91  # a status line; with its 9-column clock it fits 100 columns


def join_fitting(line: str, pieces: list[str], width: int) -> str:
    """``line`` and, two spaces apart, each of ``pieces`` (in order) that still fits in ``width``:
    a piece is left out whole, never cut inside a number. An empty ``line`` takes the first piece."""
    for piece in filter(None, pieces):
        if not line:
            line = piece
        elif len(line) + 2 + len(piece) <= width:
            line += "  " + piece
    return line


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _count(n: int) -> str:
    return f"{n:,}" if n < 100_000 else format_tokens(n)


def status_line(p: DatasetProgress, width: int = STATUS_WIDTH) -> str:
    """One dataset in at most ``width`` columns: the numbers first, extras while they fit."""
    c = dataset_cells(p)
    line = f"{_fit(c['dataset'], 14):<14} {c['state']:<11} {c['tokens']:>11} {c['percent']:>6}  {_count(p.samples)} smp"
    if not p.state.terminal:
        line += f"  {c['tok_s']} tok/s  ETA {c['eta']}"
    extras = []  # in order of importance: spend (paid APIs), failures, why it stopped, the rest
    if c["cost"]:
        extras.append(f"spend {c['cost']}/{c['projected_cost']}")  # so far / at the whole budget
    if p.failures or p.bad_lines:
        extras.append(f"failed {c['failures']}")
    if p.reason and (p.state.terminal or p.state.value == "paused"):
        # the overshoot is the state's own number ("done +12"): the reason need not say it again
        extras.append(f"[{p.reason.split(', overshoot ', 1)[0]}]")
    if not p.state.terminal:
        extras.append(f"fly {c['in_flight']}")
    if p.reasoning_tokens:
        extras.append(f"thinking {c['reasoning']}")
    if p.truncated:
        extras.append(f"cut {c['truncated']}")
    if p.skipped:
        extras.append(f"skipped {_count(p.skipped)} too long")
    if p.captured_rows:
        extras.append(f"captured {format_tokens(p.captured_rows)} rows {format_bytes(p.captured_bytes)}")
    for extra in extras:
        if len(line) + 2 + len(extra) <= width:
            line += "  " + extra
        elif extra.startswith("["):  # the reason matters more than fitting whole: cut it, between words
            room = width - len(line) - 3
            cut = extra[:room].rsplit(" ", 1)[0] if room > 0 else ""
            if cut:
                line += f"  {cut}~"
    return line


def run_eta_s(progress: list[DatasetProgress]) -> float | None:
    """Datasets run side by side: generation ends with the last of them (unknown while one is,
    or while one is paused: it ends when someone resumes it)."""
    live = [p for p in progress if not p.state.terminal]
    if any(p.state.value == "paused" for p in live):
        return None
    if not live or any(p.eta_s is None for p in live):
        return None
    return max(p.eta_s or 0.0 for p in live)


def _run_eta(progress: list[DatasetProgress]) -> str:
    eta = run_eta_s(progress)
    return "-" if eta is None else format_duration(eta)


def totals_cells(progress: list[DatasetProgress]) -> dict[str, str]:
    """The console's totals row, in the dataset columns: sums, the whole run's ETA and spend."""
    tokens = sum(p.tokens for p in progress)
    budget = sum(max(p.budget, p.tokens) for p in progress)
    live = [p for p in progress if not p.state.terminal and p.state.value != "paused"]
    rate = sum(p.tok_per_s for p in live)
    cost = sum(p.cost for p in progress)
    return {
        "dataset": f"total ({len(progress)})",
        "state": f"${cost:.2f}/${projected_spend(progress):.2f}" if cost else "",  # spent / when every dataset stops
        "tokens": f"{format_tokens(tokens)}/{format_tokens(budget)}",
        "bar": progress_bar(tokens / budget if budget else 0.0),
        "percent": f"{100 * tokens / budget:.1f}%" if budget else "-",
        "samples": f"{sum(p.samples for p in progress):,}",
        "avg": f"{tokens / max(1, sum(p.samples for p in progress)):.0f}",
        "req_s": format_rate(sum(p.req_per_s for p in live)),
        "tok_s": format_rate(rate),
        "reasoning": "",
        "eta": _run_eta(progress),
        "in_flight": str(sum(p.in_flight for p in progress)),
        "failures": str(sum(p.failures + p.bad_lines for p in progress)),
    }


def totals_line(progress: list[DatasetProgress], width: int = STATUS_WIDTH) -> str:
    """Every dataset together: tokens against budgets, samples, failures, spend, the run's ETA.
    What does not fit is left out whole, never cut inside a number."""
    tokens = sum(p.tokens for p in progress)
    budget = sum(max(p.budget, p.tokens) for p in progress)
    cost = sum(p.cost for p in progress)
    line = f"{'total':<14} {len(progress)} datasets {format_tokens(tokens):>7}/{format_tokens(budget)}"
    extras = [f"spend ${cost:.2f}/${projected_spend(progress):.2f}"] if cost else []  # in order of importance
    extras += [
        f"failed {sum(p.failures + p.bad_lines for p in progress)}",
        f"ETA {_run_eta(progress)}",
        f"{sum(p.samples for p in progress):,} smp",
    ]
    return join_fitting(line, extras, width)


def detail_text(d: dict) -> str:
    """A dataset's detail (``Engine.detail``) as lines: the console's detail view and ``eagleops detail``."""

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    lines = [
        f"{d['name']}: {d['state']}" + (f" ({d['reason']})" if d.get("reason") else ""),
        f"tokens {format_tokens(d['tokens'])} of {format_tokens(d['budget'])}, {d['samples']:,} samples, "
        f"{d['truncated']:,} cut at max_tokens, {format_tokens(d['reasoning_tokens'])} thinking",
        f"latency p50 {secs(d['latency_p50_s'])}  p95 {secs(d['latency_p95_s'])}  (last {d['latency_samples']:,} replies)",
    ]
    if d.get("skipped"):
        lines.append(f"skipped {d['skipped']:,} rows unsent: too long to train a reply after (failed.jsonl, kind skipped)")
    if d.get("cost"):
        lines.append(f"spend ${d['cost']:.2f}")
    if d.get("storage_error"):
        lines.append(f"cannot save: {d['storage_error']}")
    if d["endpoints"]:
        lines.append("served by: " + ", ".join(f"{url} {n:,}" for url, n in d["endpoints"].items()))
    failures = d["failures"]
    lines.append(
        f"failures ({sum(failures.values()):,}" + (", from the last 64 MiB of failed.jsonl" if d.get("failures_partial") else "") + "):"
        if failures
        else "failures: none"
    )
    lines += [f"  {n:>7,}  {kind}" for kind, n in list(failures.items())[:8]]
    lines += [f"source {d['source']}", f"output {d['output']}"]
    return "\n".join(lines)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def format_event(event: Event) -> str | None:
    """A readable line for events worth a line of their own (progress goes via status_line)."""
    if isinstance(event, LogEvent):
        return f"{_clock(event.at)} {event.level.upper():<7} {event.message}"
    if isinstance(event, RunState):
        ended = f" (exit {event.exit_code})" if event.exit_code is not None else ""
        return f"{_clock(event.at)} RUN     {event.name}: {event.phase.value}{ended}, started {_clock(event.started_at)}"
    if isinstance(event, StageState):
        detail = f" ({event.detail})" if event.detail else ""
        return f"{_clock(event.at)} STAGE   {event.stage}: {event.status.value}{detail}"
    if isinstance(event, EndpointStats):
        p50 = f"{event.latency_p50_s:.2f}s" if event.latency_p50_s is not None else "-"
        p95 = f"{event.latency_p95_s:.2f}s" if event.latency_p95_s is not None else "-"
        return (
            f"{_clock(event.at)} SERVER  {event.url}  in-flight {event.in_flight}  req/s {format_rate(event.req_per_s)}  "
            f"tok/s {format_rate(event.tok_per_s)}  p50 {p50}  p95 {p95}  errors {event.errors}"
        )
    if isinstance(event, DatasetProgress):
        return f"{_clock(event.at)} {status_line(event)}"
    if isinstance(event, StageProgress):
        return f"{_clock(event.at)} PROGRESS {stage_progress_line(event)}"
    if isinstance(event, StageMetrics):
        return f"{_clock(event.at)} METRICS {event.stage}: {metrics_text(event.values)}"
    return None


def stage_progress_line(p: StageProgress) -> str:
    percent = 100 * p.done / p.total if p.total else 100.0
    extra = "".join(f"  {k} {v:.4g}" if isinstance(v, float) else f"  {k} {v}" for k, v in p.extra.items())
    return (
        f"{p.stage}: {format_tokens(p.done)}/{format_tokens(p.total)} {p.unit} ({percent:.1f}%)  "
        f"{format_rate(p.rate)} {p.unit}/s  ETA {format_duration(p.eta_s)}{extra}"
    )


def metrics_text(values: dict) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, list):
            parts.append(f"{key} [" + " ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value) + "]")
        else:
            parts.append(f"{key} {value}")
    return "  ".join(parts)


def json_line(event: Event) -> str:
    return json.dumps(event.to_json(), separators=(",", ":"))
