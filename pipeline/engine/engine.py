"""The engine: a thin host for the stages. It holds the output directory's lock, the event bus,
redaction, the control socket and telemetry, runs the stages in order, and forwards commands.

What a stage decides (what to send, when to stop, how to train) lives in the stage; stages
reach the engine only through ``StageHost`` (publish, log, set_stage) and never import it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import aiohttp

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.engine.bus import EventBus, Subscription
from eagleops.pipeline.engine.compute import ComputeStages
from eagleops.pipeline.engine.telemetry import GpuReader, gpu_reader_from_env, telemetry_loop
from eagleops.pipeline.errors import EagleOpsError, ExitCode, RunError
from eagleops.pipeline.files import try_lock
from eagleops.pipeline.generate.capture import CapturePlan
from eagleops.pipeline.generate.fit import PromptFit
from eagleops.pipeline.generate.stage import GenerateStage
from eagleops.pipeline.generate.store import StoreError
from eagleops.pipeline.protocol.control import ControlError, ControlServer, socket_path_for
from eagleops.pipeline.protocol.events import (
    Ack,
    Command,
    DatasetProgress,
    DatasetState,
    EndpointStats,
    Event,
    Kill,
    LogEvent,
    Pause,
    Resume,
    RunPhase,
    RunState,
    StageState,
    StageStatus,
)
from eagleops.pipeline.protocol.redact import Redactor
from eagleops.pipeline.stages import STAGE_NAMES

__all__ = ["Engine", "EngineError", "RunSummary"]

SNAPSHOT_LOG_LINES = 50
AnyEvent = TypeVar("AnyEvent", bound=Event)


class EngineError(RunError):
    """The engine cannot start: the output directory is locked or its store does not match."""


@dataclass
class RunSummary:
    datasets: list[DatasetProgress]
    killed: bool
    stages: dict[str, StageStatus] = field(default_factory=dict)
    max_failed_share: float = 1.0

    def shortfalls(self) -> list[str]:
        """Datasets that finished but whose output a script should not take as it is: too many
        rows failed (``max_failed_share``), or nothing was written at all."""
        found = []
        for d in self.datasets:
            failed = d.failures + d.bad_lines
            rows = d.samples + failed
            if d.state == DatasetState.DONE and d.samples == 0:
                found.append(f"{d.name}: nothing written ({failed} rows failed)")
            elif rows and failed / rows > self.max_failed_share:
                found.append(f"{d.name}: {failed} of {rows} rows failed (over max_failed_share {self.max_failed_share:g})")
        return found

    @property
    def ok(self) -> bool:
        return (
            not self.killed
            and all(d.state == DatasetState.DONE for d in self.datasets)
            and all(s in (StageStatus.DONE, StageStatus.PENDING, StageStatus.SKIPPED) for s in self.stages.values())
        )

    @property
    def exit_code(self) -> int:
        """0 done, 1 a stage or dataset failed, 3 done but a dataset's output is empty or mostly
        failures (``shortfalls``), 130 killed."""
        if self.killed:
            return ExitCode.KILLED
        if not self.ok:
            return ExitCode.FAILED
        return ExitCode.SHORTFALL if self.shortfalls() else ExitCode.OK


class Engine:
    def __init__(
        self,
        config: RunConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        progress_interval_s: float = 1.0,
        telemetry_interval_s: float = 2.0,
        gpu_reader: GpuReader | None = None,
        stages: tuple[str, ...] | None = None,
    ):
        self.stages = tuple(stages) if stages is not None else config.stage_names
        self.config = config
        self.telemetry_interval_s = telemetry_interval_s
        self.gpu_reader = gpu_reader or gpu_reader_from_env()
        self.latest_telemetry: dict[str, Event] = {}
        self.redact = Redactor(config.secrets())
        self.bus = EventBus(self.snapshot)
        self.stage_states = {
            name: StageState(name, StageStatus.PENDING if name in self.stages else StageStatus.SKIPPED) for name in STAGE_NAMES
        }
        self.generate = GenerateStage(config, self, clock=clock, progress_interval_s=progress_interval_s)
        self.compute = ComputeStages(config, self)
        self._killed = False
        self._lock_file: IO[str] | None = None
        self.run_state = RunState(config.name, RunPhase.LIVE, time.time())

    @property
    def stage_results(self) -> dict[str, object]:
        return self.compute.results

    # ---- StageHost: how stages are heard --------------------------------------------------------
    def publish(self, event: Event) -> None:
        """Every event leaves through here, so every stage's words pass the one redactor: a log
        line or a stage's detail naming a secret says ``***`` instead, whoever wrote it."""
        self.bus.publish(self._scrubbed(event))

    def _scrubbed(self, event: AnyEvent) -> AnyEvent:
        if isinstance(event, LogEvent):
            return dataclasses.replace(event, message=self.redact(event.message))
        if isinstance(event, StageState) and event.detail:
            return dataclasses.replace(event, detail=self.redact(event.detail))
        return event

    def log(self, level: str, message: str, dataset: str | None = None) -> None:
        self.publish(LogEvent(level, message, dataset))

    def set_stage(self, name: str, status: StageStatus, detail: str = "") -> None:
        state = self.stage_states[name] = self._scrubbed(StageState(name, status, detail))  # the snapshot's copy too
        self.bus.publish(state)

    def fail_stage(self, name: str, exc: BaseException) -> None:
        """The one failure policy, for every stage: the error logged and the stage FAILED with it
        (the run goes on to its summary; the stages after it do not start)."""
        self.log("error", f"{name}: {type(exc).__name__}: {exc}" if not isinstance(exc, EagleOpsError) else f"{name}: {exc}")
        self.set_stage(name, StageStatus.FAILED, str(exc)[:200])

    # ---- what the control socket serves ---------------------------------------------------------
    def subscribe(self) -> Subscription:
        return self.bus.subscribe()

    def snapshot(self) -> list[Event]:
        events: list[Event] = [self.run_state, *self.stage_states.values()]
        events += [runner.progress() for runner in self.generate.runners.values()]
        events += self.endpoint_stats()
        events += self.latest_telemetry.values()
        events += self.bus.progress_latest.values()
        events += self.bus.metrics_tail  # train's loss and accuracy so far: an attached console plots them all
        events += self.bus.log_tail[-SNAPSHOT_LOG_LINES:]
        return events

    def endpoint_stats(self, *, ended: bool = False) -> list[EndpointStats]:
        return self.generate.endpoint_stats(ended=ended)

    async def execute(self, command: Command) -> Ack:
        """A command for the run, one stage or one dataset, as it says (``Command.addressed``)."""
        name = command.dataset
        if command.stage is not None:
            ack = await self._stage_command(command, command.stage)
        elif name is not None and name not in self.generate.runners and name in STAGE_NAMES:
            ack = Ack(False, f"no dataset {name}; a stage is addressed as a stage (eagleops {command.kind} --stage {name})")
        elif isinstance(command, Kill) and name is None:
            self.kill()
            ack = Ack(True, "killing the run: in-flight requests cancelled, finished work kept")
        else:
            if name is None and isinstance(command, (Pause, Resume)):
                for stage in self.compute.running:
                    self.compute.command(type(command)(stage=stage))
            ack = await self.generate.execute(command)
        dataset = name if name in self.generate.runners else None
        self.log("info" if ack.ok else "warning", f"command {command.kind} {command.stage or name or '*'}: {ack.message}", dataset)
        return ack

    async def _stage_command(self, command: Command, stage: str) -> Ack:
        """Pause or resume a stage (generate's: every dataset), or kill the run from it."""
        if stage not in STAGE_NAMES:
            return Ack(False, f"no stage {stage}; the stages are {', '.join(STAGE_NAMES)}")
        generating = stage == "generate" and self.stage_states["generate"].status in (StageStatus.RUNNING, StageStatus.PAUSED)
        if isinstance(command, Kill):
            if not generating and stage not in self.compute.running:
                return Ack(False, f"stage {stage} is not running")
            self.kill()
            return Ack(True, f"killing {stage}: it stops at once (generate) or at its next batch, its work so far kept")
        if stage == "generate":
            return await self.generate.execute(type(command)())
        return self.compute.command(command)

    async def detail(self, name: str) -> dict[str, Any]:
        return await self.generate.detail(name)

    async def serve_socket(self) -> ControlServer | None:
        """Serve this engine's commands on its run's socket; a run goes on without one if it can't."""
        server = ControlServer(self, socket_path_for(self.config.name, self.config.output_dir))
        try:
            await server.start()
        except (ControlError, OSError) as exc:
            self.log("warning", f"control socket unavailable: {exc}")
            return None
        self.log("info", f"control socket: {server.path} (eagleops attach / status)")
        return server

    # ---- lifecycle ----------------------------------------------------------------------------
    def _lock_output(self) -> None:
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        lock, holder = try_lock(self.config.layout.lock)
        if lock is None:
            who = f" (pid {holder})" if holder else ""
            raise EngineError(f"{self.config.output_dir}: another eagleops run{who} is using this output directory")
        self._lock_file = lock

    async def open(self) -> None:
        """Lock the output directory and recover every dataset's store (O(1) per dataset)."""
        self._lock_output()
        if "generate" not in self.stages:
            return
        # thinking on and off in the words the target's own template reads (Kimi `thinking`,
        # Qwen3 `enable_thinking`, gpt-oss `reasoning_effort`); learning them loads its
        # tokenizer, so off the event loop
        from eagleops.pipeline.training.modeling.profile import with_target_thinking_switch

        self.config = self.generate.config = await asyncio.to_thread(with_target_thinking_switch, self.config)
        if self.config.target is not None:  # nothing is paid for that prepare would not train
            self.generate.shared.fit = await asyncio.to_thread(self._prompt_fit)
        if self.config.extract.during_generate:
            self.generate.capture_plan = await asyncio.to_thread(self._capture_plan)
        try:
            await self.generate.open()
        except StoreError as exc:
            raise EngineError(str(exc)) from None
        except OSError as exc:
            where = exc.filename or self.config.output_dir
            raise EngineError(f"{where}: cannot open the output ({exc.strerror or exc})") from None

    def _capture_plan(self) -> CapturePlan:
        """What the serving target captures as it generates: extract's layers, in extract's numbering."""
        from eagleops.pipeline.training.features.layout import aux_layers_for_run
        from eagleops.pipeline.training.modeling.profile import target_profile

        profile = target_profile(self.config)
        return CapturePlan(aux_layers_for_run(self.config, profile.num_layers), multimodal=profile.multimodal)

    def _prompt_fit(self) -> PromptFit | None:
        from eagleops.pipeline.training.prepare.fit import prompt_counter

        config = self.config
        try:
            count = prompt_counter(config)
        except EagleOpsError as exc:
            self.log("warning", f"prompt lengths are not checked before sending: {exc}")
            return None
        return PromptFit(count, config.prepare.max_length, config.sampling.min_reply_tokens, config.sampling.max_tokens)

    def _set_run_state(self, phase: RunPhase, exit_code: int | None = None) -> None:
        ended = time.time() if phase == RunPhase.FINISHED else None
        self.run_state = RunState(self.config.name, phase, self.run_state.started_at, exit_code, ended)
        self.publish(self.run_state)

    async def run(self) -> RunSummary:
        if self._lock_file is None:
            await self.open()
        self.run_state = RunState(self.config.name, RunPhase.STOPPING if self._killed else RunPhase.LIVE, time.time())
        self.publish(self.run_state)
        # telemetry has connections of its own: /metrics must answer when generation holds them all
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4), trust_env=False) as scrapes:
            telemetry = asyncio.create_task(
                telemetry_loop(scrapes, self.gpu_reader, self.generate.endpoints, self._reading, self.log, self.telemetry_interval_s),
                name="telemetry",
            )
            try:
                await self._run_stages()
            finally:
                telemetry.cancel()
                await asyncio.gather(telemetry, return_exceptions=True)
        for event in self.endpoint_stats(ended=True):
            self.publish(event)
        datasets = [r.progress() for r in self.generate.runners.values()]
        stages = {k: v.status for k, v in self.stage_states.items()}
        summary = RunSummary(datasets, self._killed, stages, self.config.max_failed_share)
        if summary.ok:
            for shortfall in summary.shortfalls():
                self.log("error", f"{shortfall}; the run exits with code {int(ExitCode.SHORTFALL)}")
        self._set_run_state(RunPhase.FINISHED, summary.exit_code)
        self.bus.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        return summary

    async def _run_stages(self) -> None:
        if "generate" in self.stages:
            try:
                await self.generate.run()
            except Exception as exc:  # a bug, not a refusal: generate's own errors set its state
                self.fail_stage("generate", exc)
        for group in self.compute.groups(self.stages):
            if self._killed or any(state.status == StageStatus.FAILED for state in self.stage_states.values()):
                break
            await self.compute.run_together(group)

    def _reading(self, key: str, event: Event) -> None:
        self.latest_telemetry[key] = event
        self.publish(event)

    def kill(self) -> None:
        """Stop everything now (Ctrl-C): cancel in-flight requests, keep finished work."""
        if self._killed:
            return
        self._killed = True
        if self.run_state.phase == RunPhase.LIVE:
            self._set_run_state(RunPhase.STOPPING)
        self.compute.kill()
        self.generate.kill()
