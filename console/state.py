"""What the console knows: the latest event of each kind, plus short histories for the plots.

Events update this at whatever rate they arrive; widgets read it once per render tick, so a
burst of events costs one repaint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipeline.protocol.events import (
    DatasetProgress,
    EndpointStats,
    Event,
    GpuStats,
    HostStats,
    ServerMetrics,
    StageMetrics,
    StageProgress,
    StageState,
)

HISTORY = 300  # samples kept for sparklines (5 minutes at the engine's 1 Hz)


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
    version: int = 0  # bumped on every change; a widget repaints only when it moved

    def apply(self, event: Event) -> None:
        self.version += 1
        if isinstance(event, DatasetProgress):
            self.datasets[event.name] = event
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
        else:
            self.version -= 1
