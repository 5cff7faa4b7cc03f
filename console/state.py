"""What the console knows: the latest event of each kind, plus short histories for the plots.

Events update this at whatever rate they arrive; widgets read it once per render tick, so a
burst of events costs one repaint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from eagleops.pipeline.protocol.events import (
    DatasetProgress,
    EndpointStats,
    Event,
    GpuStats,
    HostStats,
    RunState,
    ServerMetrics,
    StageMetrics,
    StageProgress,
    StageState,
)

HISTORY = 300  # samples kept for sparklines (5 minutes at the engine's 1 Hz)
FAILURE_WINDOW_S = 60.0  # failures per minute over the last minute


@dataclass
class ConsoleState:
    datasets: dict[str, DatasetProgress] = field(default_factory=dict)
    stages: dict[str, StageState] = field(default_factory=dict)
    endpoints: dict[str, EndpointStats] = field(default_factory=dict)
    servers: dict[str, ServerMetrics] = field(default_factory=dict)
    gpu: GpuStats | None = None
    host: HostStats | None = None
    gpu_history: dict[int, deque] = field(default_factory=dict)
    throughput: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    stage_progress: dict[str, StageProgress] = field(default_factory=dict)
    stage_metrics: dict[str, dict] = field(default_factory=dict)
    train_loss: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    acc_history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # per logged step: accuracy at each draft position
    run: RunState | None = None
    engine_gone: bool = False  # the link broke before the engine said it finished: figures are stale
    gone_at: float | None = None
    failure_counts: deque = field(default_factory=lambda: deque(maxlen=4 * HISTORY))  # (at, new failures of one dataset)
    first_progress_at: float | None = None
    version: int = 0  # bumped on every change; a widget repaints only when it moved

    def apply(self, event: Event) -> None:
        self.version += 1
        if isinstance(event, DatasetProgress):
            before = self.datasets.get(event.name)
            self.datasets[event.name] = event
            if self.first_progress_at is None:
                self.first_progress_at = event.at
            if before is not None:  # a dataset first seen brings its past failures, not new ones
                new = (event.failures + event.bad_lines) - (before.failures + before.bad_lines)
                if new > 0:
                    self.failure_counts.append((event.at, new))
        elif isinstance(event, RunState):
            self.run = event
        elif isinstance(event, StageState):
            self.stages[event.stage] = event
        elif isinstance(event, EndpointStats):
            self.endpoints[event.url] = event
            if event.url == next(iter(self.endpoints)):  # one sample per engine tick
                self.throughput.append(sum(e.tok_per_s for e in self.endpoints.values()))
        elif isinstance(event, ServerMetrics):
            self.servers[event.url] = event
        elif isinstance(event, GpuStats):
            self.gpu = event
            for gpu in event.gpus:
                history = self.gpu_history.setdefault(gpu[0], deque(maxlen=HISTORY))
                history.append(gpu[2] if gpu[2] is not None else 0.0)
        elif isinstance(event, HostStats):
            self.host = event
        elif isinstance(event, StageProgress):
            self.stage_progress[event.stage] = event
        elif isinstance(event, StageMetrics):
            self.stage_metrics.setdefault(event.stage, {}).update(event.values)
            if event.stage == "train" and "step" in event.values and "loss" in event.values:
                self.train_loss.append(float(event.values["loss"]))
                self.acc_history.append(list(event.values.get("acc") or []))
        else:
            self.version -= 1

    def lose_engine(self, at: float) -> None:
        """The engine went without finishing: what is shown is its last word, not live."""
        if not self.engine_gone:
            self.engine_gone, self.gone_at = True, at
            self.version += 1

    def failures_per_minute(self, now: float) -> float | None:
        """New failures per minute over the last minute (or since the first reading, if later);
        None before any dataset reported."""
        if self.first_progress_at is None:
            return None
        window = max(10.0, min(FAILURE_WINDOW_S, now - self.first_progress_at))
        return 60.0 * sum(n for at, n in self.failure_counts if at > now - window) / window
