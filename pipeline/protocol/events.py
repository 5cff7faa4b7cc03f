"""Typed events out of the engine and typed commands into it.

All are frozen dataclasses with a JSON form (``to_json``/``from_json``), so the console, the
``--no-tui`` printer and a process attached over the control socket see exactly the same thing.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from eagleops.pipeline.config.tokens import parse_tokens

__all__ = [
    "Ack",
    "Command",
    "DatasetProgress",
    "DatasetState",
    "EndpointStats",
    "Event",
    "GpuStats",
    "HostStats",
    "RunPhase",
    "RunState",
    "ServerMetrics",
    "StageMetrics",
    "StageProgress",
    "Kill",
    "LogEvent",
    "Pause",
    "Resume",
    "SetBudget",
    "StageState",
    "StageStatus",
    "StopReason",
    "command_from_json",
    "event_from_json",
]


class DatasetState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"  # budget (or sample cap) reached, or the source exhausted
    KILLED = "killed"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (DatasetState.DONE, DatasetState.KILLED, DatasetState.FAILED)


class StopReason(StrEnum):
    """Why a dataset stopped issuing requests; the value is what a person reads."""

    BUDGET = "budget reached"
    SAMPLE_CAP = "sample cap reached"
    SOURCE_EXHAUSTED = "source exhausted"
    STOPPED = "stopped"  # its endpoints went away (a served target that died) or the run ended it
    KILLED = "killed; resumable"
    FAILED = "failed"  # the reason text says what failed

    @property
    def by_limit(self) -> bool:
        """A limit stopped it: raising that limit lets it go on."""
        return self in (StopReason.BUDGET, StopReason.SAMPLE_CAP)


class StageStatus(StrEnum):
    SKIPPED = "skipped"  # not one of this run's stages
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    KILLED = "killed"
    FAILED = "failed"


class RunPhase(StrEnum):
    LIVE = "live"
    STOPPING = "stopping"  # killed: in-flight work being cancelled, finished work kept
    FINISHED = "finished"  # with its exit code


@dataclass(frozen=True, slots=True)
class Event:
    kind: ClassVar[str] = "event"

    def to_json(self) -> dict[str, Any]:
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        payload["type"] = self.kind
        return payload


@dataclass(frozen=True, slots=True)
class DatasetProgress(Event):
    kind: ClassVar[str] = "dataset"
    name: str
    state: DatasetState
    tokens: int
    budget: int
    samples: int
    in_flight: int = 0
    failures: int = 0
    bad_lines: int = 0
    truncated: int = 0
    skipped: int = 0  # rows not sent: their reply could not be trained (too long)
    max_samples: int | None = None
    req_per_s: float = 0.0
    tok_per_s: float = 0.0
    eta_s: float | None = None
    cost: float = 0.0
    reasoning_tokens: int = 0  # of tokens, spent thinking
    reason: str = ""  # why it is in its state, in words ("budget reached, overshoot 12 tokens", a failure)
    stopped_by: StopReason | None = None  # why it stopped, typed: set once it has
    captured_rows: int = 0  # hidden-state rows the serving target captured as it generated (during_generate)
    captured_bytes: int = 0  # their chunks on disk
    at: float = field(default_factory=time.time)

    @property
    def overshoot(self) -> int:
        return max(0, self.tokens - self.budget)

    @property
    def fraction(self) -> float:
        return min(1.0, self.tokens / self.budget) if self.budget else 1.0

    @property
    def reasoning_share(self) -> float:
        return self.reasoning_tokens / self.tokens if self.tokens else 0.0

    @property
    def mean_completion(self) -> float:
        return self.tokens / self.samples if self.samples else 0.0


@dataclass(frozen=True, slots=True)
class EndpointStats(Event):
    kind: ClassVar[str] = "endpoint"
    url: str
    in_flight: int
    requests: int
    errors: int
    req_per_s: float
    tok_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    benched_s: float | None = None  # seconds this endpoint gets no requests yet, after failures
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class StageState(Event):
    kind: ClassVar[str] = "stage"
    stage: str
    status: StageStatus
    detail: str = ""
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class LogEvent(Event):
    kind: ClassVar[str] = "log"
    level: str  # "info" | "warning" | "error"
    message: str
    dataset: str | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class GpuStats(Event):
    """Every GPU of the engine's host: (index, name, util %, mem used B, mem total B, temp C, power W);
    any field may be None (N/A). ``error`` says why there are none ("no NVIDIA GPU")."""

    kind: ClassVar[str] = "gpu"
    gpus: tuple[tuple, ...]
    error: str | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class HostStats(Event):
    kind: ClassVar[str] = "host"
    cpu_percent: float
    mem_used: int
    mem_total: int
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class ServerMetrics(Event):
    """What a server says of itself on /metrics."""

    kind: ClassVar[str] = "server"
    url: str
    software: str = ""  # "sglang", "vllm", "eagleops" (our model server) or "none"
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    gen_tok_per_s: float | None = None
    accept_length: float | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class StageProgress(Event):
    """How far a compute stage is: ``done`` of ``total`` ``unit``s (samples, tokens, steps)."""

    kind: ClassVar[str] = "stage_progress"
    stage: str
    done: float
    total: float
    unit: str
    rate: float = 0.0
    eta_s: float | None = None
    extra: dict = field(default_factory=dict)
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class StageMetrics(Event):
    """A stage's measurements: train loss and per-step accuracy, extract tokens/s and bytes/token,
    eval acceptance length ..."""

    kind: ClassVar[str] = "stage_metrics"
    stage: str
    values: dict
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class RunState(Event):
    """The run as a whole: its name, since when it runs (wall clock), where it is, and once it has
    finished the exit code the engine's process returns (0 done, 1 failed, 3 shortfall, 130 killed)."""

    kind: ClassVar[str] = "run"
    name: str
    phase: RunPhase
    started_at: float
    exit_code: int | None = None
    ended_at: float | None = None
    at: float = field(default_factory=time.time)


_EVENTS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        DatasetProgress, EndpointStats, StageState, LogEvent, GpuStats, HostStats, ServerMetrics, StageProgress, StageMetrics, RunState,
    )
}  # fmt: skip
_ENUM_FIELDS = {"state": DatasetState, "status": StageStatus, "stopped_by": StopReason, "phase": RunPhase}


def event_from_json(payload: dict[str, Any]) -> Event:
    payload = dict(payload)
    cls = _EVENTS[payload.pop("type")]
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in payload.items() if k in names}
    for key, enum in _ENUM_FIELDS.items():
        if kwargs.get(key) is not None:
            kwargs[key] = enum(kwargs[key])
    if cls is GpuStats:
        kwargs["gpus"] = tuple(tuple(g) for g in kwargs.get("gpus", ()))
    return cls(**kwargs)


# ---- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """A command for the whole run, one stage (``stage``) or one dataset (``dataset``): at most
    one of the two is set, and neither means the run."""

    kind: ClassVar[str] = "command"
    dataset: str | None = None
    stage: str | None = field(default=None, kw_only=True)

    @property
    def addressed(self) -> str:
        """What it is for, in words: ``the run``, ``stage train``, ``dataset B1``."""
        if self.stage is not None:
            return f"stage {self.stage}"
        return f"dataset {self.dataset}" if self.dataset is not None else "the run"

    def to_json(self) -> dict[str, Any]:
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if payload["stage"] is None:  # a dataset's or the run's command reads as it always has
            del payload["stage"]
        payload["cmd"] = self.kind
        return payload


@dataclass(frozen=True, slots=True)
class Pause(Command):
    kind: ClassVar[str] = "pause"


@dataclass(frozen=True, slots=True)
class Resume(Command):
    kind: ClassVar[str] = "resume"


@dataclass(frozen=True, slots=True)
class Kill(Command):
    kind: ClassVar[str] = "kill"


@dataclass(frozen=True, slots=True)
class SetBudget(Command):
    kind: ClassVar[str] = "budget"
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Ack:
    ok: bool
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "message": self.message}


_COMMANDS: dict[str, type[Command]] = {cls.kind: cls for cls in (Pause, Resume, Kill, SetBudget)}


def command_from_json(payload: dict[str, Any]) -> Command:
    payload = dict(payload)
    name = payload.pop("cmd", None)
    if name not in _COMMANDS:
        raise ValueError(f"unknown command {name!r}; expected one of {', '.join(_COMMANDS)}")
    cls = _COMMANDS[name]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(payload) - names
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
    dataset, stage = payload.get("dataset"), payload.get("stage")
    for key, value in (("dataset", dataset), ("stage", stage)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name}: {key} must be a string")
    if dataset is not None and stage is not None:
        raise ValueError(f"{name}: a dataset or a stage, not both")
    if cls is SetBudget:
        tokens = payload.get("tokens")
        if tokens is None:
            raise ValueError("budget: tokens: missing")
        try:  # as the run file and the command line read a token count: the same range, the same words
            payload["tokens"] = parse_tokens(tokens)
        except ValueError as exc:
            raise ValueError(f"budget: tokens: {exc}") from None
        if dataset is None or stage is not None:
            raise ValueError("budget: a dataset is required (budgets are a dataset's)")
    return cls(**payload)
