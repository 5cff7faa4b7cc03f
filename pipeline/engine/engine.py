"""The async engine: the generate stage over every dataset, with events out and commands in.

Structure: one runner task per dataset (a TaskGroup of request tasks inside it), one shared
slot semaphore that caps records in flight, one flusher that makes finished records durable in
batches, one ticker that publishes progress snapshots. Commands only flip state and wake the
runners; kill cancels tasks, which closes their HTTP connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import IO

import aiohttp

from pipeline.config import ALL_STAGES, EndpointConfig, RunConfig, format_tokens
from pipeline.engine.bus import EventBus, Subscription
from pipeline.engine.commands import EngineCommands
from pipeline.engine.compute import EngineStages
from pipeline.engine.datasets import DatasetRunner
from pipeline.engine.digest import RetryDigest
from pipeline.engine.telemetry import GpuReader, gpu_reader_from_env, telemetry_loop
from pipeline.errors import EagleOpsError, RunError
from pipeline.files import try_lock
from pipeline.generate.client import ChatClient, EndpointPool, TokenCounter
from pipeline.generate.endpoints import connection_limit
from pipeline.generate.store import DatasetStore, StoreError, WriteFailed
from pipeline.protocol.control import ControlError, ControlServer, socket_path_for
from pipeline.protocol.events import DatasetProgress, DatasetState, EndpointStats, Event, LogEvent, StageState, StageStatus
from pipeline.protocol.redact import Redactor
from pipeline.servers.supervisor import SupervisedServer
from pipeline.training.context import StageContext

__all__ = ["STAGES", "Engine", "EngineError", "RunSummary"]

STAGES = ALL_STAGES
SNAPSHOT_LOG_LINES = 50


class EngineError(RunError):
    """The engine cannot start: the output directory is locked or its store does not match."""


@dataclass
class RunSummary:
    datasets: list[DatasetProgress]
    killed: bool
    stages: dict[str, StageStatus] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.killed
            and all(d.state == DatasetState.DONE for d in self.datasets)
            and all(s in (StageStatus.DONE, StageStatus.PENDING, StageStatus.SKIPPED) for s in self.stages.values())
        )


class Engine(EngineCommands, EngineStages):
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
        self.config = config
        self.clock = clock
        self.progress_interval_s = progress_interval_s
        self.telemetry_interval_s = telemetry_interval_s
        self.gpu_reader = gpu_reader or gpu_reader_from_env()
        self.latest_telemetry: dict[str, Event] = {}
        self.redact = Redactor(config.secrets())
        # generated text is rewritten only for keys long enough to be real: a placeholder key such
        # as vLLM's usual "EMPTY" must not turn every "EMPTY" the target writes into ***
        self.redact_data = Redactor(config.secrets(), min_length=16)
        self.bus = EventBus(self.snapshot)
        self.runners: dict[str, DatasetRunner] = {}
        self.stages = tuple(stages) if stages is not None else config.stage_names
        self.stage_states = {name: StageState(name, StageStatus.PENDING if name in self.stages else StageStatus.SKIPPED) for name in STAGES}
        self.stage_results: dict[str, object] = {}
        self._stage_ctxs: dict[str, StageContext] = {}  # the compute stages running (two while train follows extract)
        self.slots = asyncio.Semaphore(config.concurrency)
        self.pool = self._pool(config.endpoints)
        self.client: ChatClient  # set in run()
        self._flush_now = asyncio.Event()
        self._changed = asyncio.Event()
        self._killed = False
        self._lock_file: IO[str] | None = None
        self._models = {ep.label: ep.model for ep in config.endpoints}
        self._served: SupervisedServer | None = None  # vLLM serving the target, while it does
        self._served_failure: str | None = None

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self) -> Subscription:
        return self.bus.subscribe()

    def publish(self, event: Event) -> None:
        self.bus.publish(event)

    def log(self, level: str, message: str, dataset: str | None = None) -> None:
        self.publish(LogEvent(level, self.redact(message), dataset))

    def snapshot(self) -> list[Event]:
        events: list[Event] = list(self.stage_states.values())
        events += [runner.progress() for runner in self.runners.values()]
        events += self.endpoint_stats()
        events += self.latest_telemetry.values()
        events += self.bus.log_tail[-SNAPSHOT_LOG_LINES:]
        return events

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

    def endpoint_stats(self, *, ended: bool = False) -> list[EndpointStats]:
        return self.pool.stats(ended=ended)

    def _pool(self, endpoints: tuple[EndpointConfig, ...]) -> EndpointPool:
        bench = (max(0.05, self.config.retry.base_delay_s), max(0.05, self.config.retry.max_delay_s))
        return EndpointPool(endpoints, base_bench_s=bench[0], max_bench_s=bench[1])

    def model_for(self, label: str) -> str:
        return self._models.get(label, "")

    # ---- lifecycle ----------------------------------------------------------------------------
    def _start(self, runner: DatasetRunner) -> None:
        runner.task = asyncio.create_task(self._run_runner(runner), name=f"dataset:{runner.config.name}")

    async def _run_runner(self, runner: DatasetRunner) -> None:
        try:
            await runner.run()
        except asyncio.CancelledError:
            runner._finish(DatasetState.KILLED, "killed; resumable")
            # Swallow: a killed dataset is a state, not an error of the engine.
        except Exception as exc:
            runner._finish(DatasetState.FAILED, self.redact(f"{type(exc).__name__}: {exc}"))
        finally:
            self._changed.set()

    def request_flush(self) -> None:
        self._flush_now.set()

    async def save(self, runner: DatasetRunner, *, force_manifest: bool = False) -> bool:
        """Make one dataset's finished records durable. A failed write pauses the dataset (its
        records stay in memory) until a later try, with backoff, succeeds."""
        try:
            await runner.store.flush(force_manifest=force_manifest)
        except WriteFailed as exc:
            runner.storage_failed(self.redact(str(exc)))
            return False
        if runner.storage_error is not None:
            runner.storage_recovered()
        return True

    async def _flusher(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), self.config.flush_interval_s)
            self._flush_now.clear()
            for runner in self.runners.values():
                if runner.store.unsaved() and runner.storage_retry_due():
                    await self.save(runner)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            for runner in self.runners.values():
                self.publish(runner.progress())
            for stats in self.endpoint_stats():
                self.publish(stats)

    def _lock_output(self) -> None:
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        lock, holder = try_lock(self.config.output_dir / ".lock")
        if lock is None:
            who = f" (pid {holder})" if holder else ""
            raise EngineError(f"{self.config.output_dir}: another eagleops run{who} is using this output directory")
        self._lock_file = lock

    async def open(self) -> None:
        """Lock the output directory and recover every dataset's store (O(1) per dataset)."""
        self._lock_output()
        if "generate" not in self.stages:
            return
        for ds in self.config.datasets:
            store = DatasetStore(self.config.output_dir / ds.name, ds.name, ds.path)
            try:
                await asyncio.to_thread(store.open)
            except StoreError as exc:
                raise EngineError(str(exc)) from None
            except OSError as exc:
                raise EngineError(f"{store.directory}: cannot open the output ({exc.strerror or exc})") from None
            runner = DatasetRunner(self, ds, store)
            self.runners[ds.name] = runner
            if store.recovered_records or store.repaired_bytes:
                self.log(
                    "warning",
                    f"{ds.name}: recovered {store.recovered_records} records written after the last manifest"
                    + (f", truncated a torn {store.repaired_bytes}-byte tail" if store.repaired_bytes else ""),
                    ds.name,
                )
            if store.budget_override is not None and store.budget_override != ds.token_budget:
                self.log(
                    "info",
                    f"{ds.name}: budget {format_tokens(store.budget_override)} (set live; run file says {format_tokens(ds.token_budget)})",
                    ds.name,
                )

    async def run(self) -> RunSummary:
        if self._lock_file is None:
            await self.open()
        connections, warning = connection_limit(self.config.concurrency, len(self.config.datasets))
        if warning is not None:  # fewer requests in flight, so none waits for a connection on its timeout
            self.log("warning", warning)
            self.slots = asyncio.Semaphore(connections)
        connector = aiohttp.TCPConnector(limit=connections, ttl_dns_cache=300, enable_cleanup_closed=True)
        # telemetry has connections of its own: /metrics must answer when generation holds them all
        async with (
            aiohttp.ClientSession(connector=connector, trust_env=False) as session,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4), trust_env=False) as scrapes,
        ):
            telemetry = asyncio.create_task(telemetry_loop(self, scrapes), name="telemetry")
            try:
                if "generate" in self.stages:
                    await self._generate_with_served_target(session)
                for group in self._compute_groups():
                    if self._killed or self._stage_failed():
                        break
                    await self._compute_together(group)
            finally:
                telemetry.cancel()
                await asyncio.gather(telemetry, return_exceptions=True)
        for event in self.endpoint_stats(ended=True):
            self.publish(event)
        self.bus.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        return RunSummary([r.progress() for r in self.runners.values()], self._killed, {k: v.status for k, v in self.stage_states.items()})

    async def _generate_with_served_target(self, session: aiohttp.ClientSession) -> None:
        try:
            async with self._served_target():
                await self._generate(session)
        except EagleOpsError as exc:  # the served target did not start (or cannot be found)
            if self._killed:
                self._set_stage("generate", StageStatus.KILLED)
                return
            self.log("error", self.redact(str(exc)))
            self._set_stage("generate", StageStatus.FAILED, self.redact(str(exc))[:200])
            return
        if self._served_failure is not None:
            self._set_stage("generate", StageStatus.FAILED, self._served_failure[:200])

    @contextlib.asynccontextmanager
    async def _served_target(self) -> AsyncIterator[None]:
        """With [serve]: vLLM serves the target as one more endpoint while generate runs."""
        serve = self.config.serve
        if serve is None or not serve.for_generate:
            yield
            return
        from pipeline.servers.vllm import launch_for, vllm_server

        loop = asyncio.get_running_loop()
        launch = launch_for(self.config)
        log_path = self.config.output_dir / "servers" / "vllm-generate.log"
        server = vllm_server(launch, log_path=log_path, log=lambda level, message: loop.call_soon_threadsafe(self.log, level, message),
                             startup_timeout_s=serve.startup_timeout_s, max_restarts=serve.max_restarts,
                             on_failed=lambda reason: loop.call_soon_threadsafe(self._served_target_gone, reason))  # fmt: skip
        self._served = server
        self._set_stage("generate", StageStatus.RUNNING, "starting vLLM")
        self.log(
            "info",
            f"vllm: starting {launch.model} (tp {launch.tensor_parallel_size}, pp {launch.pipeline_parallel_size}, dp {launch.data_parallel_size})",
        )
        try:
            await asyncio.to_thread(server.start)
            endpoint = EndpointConfig(base_url=f"{server.base_url}/v1", model=launch.served_name, kind="vllm")
            self.pool = self._pool((*self.config.endpoints, endpoint))
            self._models[endpoint.label] = endpoint.model
            yield
        finally:
            await asyncio.to_thread(server.stop)
            self._served = None

    def _served_target_gone(self, reason: str) -> None:
        """vLLM died more often than it may be restarted: stop generate (resumable), mark it failed."""
        self._served_failure = reason
        for runner in self.runners.values():
            runner.stop()

    async def _generate(self, session: aiohttp.ClientSession) -> None:
        self.client = ChatClient(
            session, self.pool, self.config.sampling, self.config.retry, TokenCounter(self.config.tokenizer), redact=self.redact
        )
        digest = RetryDigest(self.log, self.config.retry_log_interval_s)
        self.client.on_retry = lambda endpoint, reason, delay: digest.note(endpoint, reason)
        self.client.on_warning = lambda message: self.log("warning", message)
        self.pool.on_health = self.log
        self._set_stage("generate", StageStatus.RUNNING)
        helpers = [
            asyncio.create_task(coro, name=name)
            for coro, name in ((self._flusher(), "flusher"), (self._ticker(), "ticker"), (digest.run(), "retry digest"))
        ]
        try:
            for runner in self.runners.values():
                self._start(runner)
            while True:
                live = [r.task for r in self.runners.values() if r.task is not None and not r.task.done()]
                if not live:
                    break
                self._changed.clear()
                await self._changed.wait()
        finally:
            if any(r.task is not None and not r.task.done() for r in self.runners.values()):
                self.kill()
            for runner in self.runners.values():
                if runner.task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await runner.task
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            for runner in self.runners.values():
                if not await asyncio.shield(self.save(runner, force_manifest=True)) and runner.store.buffered():
                    self.log(
                        "error", f"{runner.config.name}: {runner.store.buffered()} finished records not saved; a resume makes them again"
                    )
        for event in [*(r.progress() for r in self.runners.values()), *self.endpoint_stats()]:
            self.publish(event)  # the final numbers, with nothing left in flight
        states = [r.state for r in self.runners.values()]
        if self._killed:
            self._set_stage("generate", StageStatus.KILLED)
        elif DatasetState.FAILED in states:
            self._set_stage("generate", StageStatus.FAILED, "a dataset failed")
        else:
            self._set_stage("generate", StageStatus.DONE)
