"""The async engine: the generate stage over every dataset, with events out and commands in.

Structure: one runner task per dataset (a TaskGroup of request tasks inside it), one shared
slot semaphore that caps records in flight, one flusher that makes finished records durable in
batches, one ticker that publishes progress snapshots. Commands only flip state and wake the
runners; kill cancels tasks, which closes their HTTP connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp

from .client import ChatClient, Completion, EndpointPool, PermanentFailure, RateMeter, TokenCounter
from .config import ALL_STAGES, DatasetConfig, RunConfig, format_tokens
from .events import (
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
    SetBudget,
    StageState,
    StageStatus,
)
from .sources import BadLine, Prompt, SourceReader
from .stagectl import StageContext, StageKilled
from .store import DatasetStore, StoreError
from .telemetry import GpuReader, gpu_reader_from_env, read_host, scrape_metrics, server_metrics

__all__ = ["Engine", "EngineError", "Redactor", "STAGES"]

STAGES = ALL_STAGES
_FLUSH_RECORDS = 256
_READ_BATCH = 256


class EngineError(RuntimeError):
    pass


class Redactor:
    """Replaces every secret value in text that may reach a log, an event or a file."""

    def __init__(self, secrets: list[str]):
        self.secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


class Subscription:
    """A bounded queue of events; a slow reader loses the oldest, never blocks the engine."""

    def __init__(self, engine: "Engine", maxsize: int = 2000):
        self._engine = engine
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize)

    def put(self, event: Event | None) -> None:
        while True:
            try:
                self.queue.put_nowait(event)
                return
            except asyncio.QueueFull:
                self.queue.get_nowait()

    def close(self) -> None:
        self._engine._subscribers.discard(self)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        try:
            while (event := await self.queue.get()) is not None:
                yield event
        finally:
            self.close()


class DatasetRunner:
    def __init__(self, engine: "Engine", config: DatasetConfig, store: DatasetStore):
        self.engine, self.config, self.store = engine, config, store
        self.budget = store.budget_override if store.budget_override is not None else config.token_budget
        self.state = DatasetState.QUEUED
        self.reason = ""
        self.paused = False
        self.in_flight = 0
        self.meter = RateMeter(clock=engine.clock)
        self.task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._exhausted = False

    # ---- budget arithmetic ------------------------------------------------------------------
    def _estimate(self) -> float:
        """Tokens a request in flight is expected to add: the mean so far, once it means something."""
        done = self.store.accepted
        if done.samples >= 8:
            return done.tokens / done.samples
        return float(self.engine.config.sampling.max_tokens)

    def _room(self) -> bool:
        done = self.store.accepted
        if done.tokens + self.in_flight * self._estimate() >= self.budget:
            return False
        cap = self.config.max_samples
        return cap is None or done.samples + self.in_flight < cap

    def at_limit(self) -> bool:
        done = self.store.accepted
        cap = self.config.max_samples
        return done.tokens >= self.budget or (cap is not None and done.samples >= cap)

    def _limit_reason(self) -> str:
        return "budget reached" if self.store.accepted.tokens >= self.budget else "sample cap reached"

    def wake(self) -> None:
        self._wake.set()

    async def _wait(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> None:
        self.store.rewind_to_watermark()
        self._exhausted = False
        if self.at_limit():
            self._finish(DatasetState.DONE, self._limit_reason())
            return
        self._set(DatasetState.PAUSED if self.paused else DatasetState.RUNNING)
        failure: str | None = None
        try:
            async with asyncio.TaskGroup() as group:
                await self._issue(group)
        except* StoreError as errors:
            failure = str(errors.exceptions[0])
        except* OSError as errors:
            failure = f"{self.config.path}: {errors.exceptions[0]}"
        finally:
            await asyncio.shield(self.engine.flush_store(self.store))
        if failure is not None:
            self._finish(DatasetState.FAILED, failure)
            return
        if self.at_limit():
            self._finish(DatasetState.DONE, self._limit_reason())
        elif self._exhausted:
            self._finish(DatasetState.DONE, "source exhausted")
        else:
            self._finish(DatasetState.DONE, "stopped")

    async def _issue(self, group: asyncio.TaskGroup) -> None:
        offset, lines = self.store.reader_position()
        reader = SourceReader(self.config.path, self.config.format, self.config.id_field, offset=offset, line=lines)
        batches = reader.batches(_READ_BATCH)
        while True:
            batch = await asyncio.to_thread(next, batches, None)
            if batch is None:
                self._exhausted = True
                return
            for item in batch:
                if self.store.skip(item):
                    pass
                elif isinstance(item, BadLine):
                    self._bad_line(item)
                else:
                    if not await self._admit():
                        return
                    self.store.dispatched(item)
                    self.in_flight += 1
                    task = group.create_task(self._request(item), name=f"{self.config.name}:{item.prompt_id}")
                    self._requests.add(task)
                    task.add_done_callback(self._requests.discard)
                self.store.advanced(item.end, item.line)

    async def _admit(self) -> bool:
        """Wait for a slot; False once this dataset should stop issuing (budget or cap reached)."""
        slots = self.engine.slots
        while True:
            if self.paused:
                self._set(DatasetState.PAUSED)
                await self._wait()
                continue
            if not self._room():
                if self.in_flight == 0:
                    return False
                await self._wait()
                continue
            self._set(DatasetState.RUNNING)
            await slots.acquire()
            if self.paused or not self._room():
                slots.release()
                continue
            return True

    def _bad_line(self, item: BadLine) -> None:
        self.store.dispatched(item)
        self.store.add_failure(
            item,
            {
                "id": f"line:{item.line}",
                "kind": "bad_line",
                "dataset": self.config.name,
                "source_offset": item.offset,
                "source_line": item.line,
                "field": item.field,
                "reason": item.message,
            },
        )
        self.engine.log("error", item.message, self.config.name)

    async def _request(self, prompt: Prompt) -> None:
        try:
            completion = await self.engine.client.complete(prompt.messages)
        except PermanentFailure as exc:
            reason = self.engine.redact(exc.reason)
            self.store.add_failure(
                prompt,
                {
                    "id": prompt.prompt_id,
                    "kind": "request",
                    "dataset": self.config.name,
                    "source_offset": prompt.offset,
                    "source_line": prompt.line,
                    "reason": reason,
                    "attempts": exc.attempts,
                },
            )
            self.engine.log("error", f"{self.config.path.name}:{prompt.line} ({prompt.prompt_id}): {reason}", self.config.name)
        else:
            self.store.add_record(prompt, self._record(prompt, completion))
            self.meter.add(completion.completion_tokens)
            if self.engine.config.cancel_in_flight_over_budget and self.store.accepted.tokens >= self.budget:
                self.cancel_requests()
        finally:
            self.in_flight -= 1
            self.engine.slots.release()
            self.wake()
            if self.store.buffered() >= _FLUSH_RECORDS:
                self.engine.request_flush()

    def _record(self, prompt: Prompt, completion: Completion) -> dict:
        return {
            "id": prompt.prompt_id,
            "conversations": [*prompt.messages, {"role": "assistant", "content": completion.text}],
            "dataset": self.config.name,
            "source_offset": prompt.offset,
            "source_line": prompt.line,
            "finish_reason": completion.finish_reason,
            "truncated": completion.finish_reason == "length",
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "usage_source": completion.usage_source,
            "endpoint": completion.endpoint,
            "model": self.engine.model_for(completion.endpoint),
            "latency_s": round(completion.latency_s, 4),
            "attempts": completion.attempts,
            "cost": completion.cost,
            "finished_at": round(time.time(), 3),
        }

    def cancel_requests(self) -> None:
        for task in list(self._requests):
            task.cancel()

    # ---- state --------------------------------------------------------------------------------
    def _set(self, state: DatasetState) -> None:
        if state != self.state:
            self.state = state
            self.engine.publish(self.progress())

    def _finish(self, state: DatasetState, reason: str) -> None:
        self.reason = reason
        if state == DatasetState.DONE and self.store.accepted.tokens > self.budget:
            reason += f", overshoot {format_tokens(self.store.accepted.tokens - self.budget)} tokens"
            self.reason = reason
        self.state = state
        self.engine.publish(self.progress())
        level = "error" if state == DatasetState.FAILED else "info"
        self.engine.log(level, f"{self.config.name}: {state.value} ({reason})", self.config.name)

    def progress(self) -> DatasetProgress:
        totals = self.store.accepted
        req_s, tok_s = self.meter.rates()
        remaining = self.budget - totals.tokens
        eta = remaining / tok_s if (tok_s > 0 and remaining > 0 and self.state == DatasetState.RUNNING) else None
        return DatasetProgress(
            name=self.config.name,
            state=self.state,
            tokens=totals.tokens,
            budget=self.budget,
            samples=totals.samples,
            in_flight=self.in_flight,
            failures=totals.failures,
            bad_lines=totals.bad_lines,
            truncated=totals.truncated,
            max_samples=self.config.max_samples,
            req_per_s=round(req_s, 3),
            tok_per_s=round(tok_s, 1),
            eta_s=round(eta, 1) if eta is not None else None,
            cost=round(totals.cost, 6),
            reason=self.reason,
        )


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
            and all(s in (StageStatus.DONE, StageStatus.PENDING) for s in self.stages.values())
        )


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
        self.config = config
        self.clock = clock
        self.progress_interval_s = progress_interval_s
        self.telemetry_interval_s = telemetry_interval_s
        self.gpu_reader = gpu_reader or gpu_reader_from_env()
        self._telemetry: dict[str, Event] = {}
        self.redact = Redactor(config.secrets())
        self._subscribers: set[Subscription] = set()
        self._log_tail: list[LogEvent] = []
        self.runners: dict[str, DatasetRunner] = {}
        self.stages = tuple(stages) if stages is not None else config.stages
        self.stage_states: dict[str, StageState] = {name: StageState(name, StageStatus.PENDING) for name in STAGES}
        self.stage_results: dict[str, object] = {}
        self._stage_ctx: StageContext | None = None
        self.slots = asyncio.Semaphore(config.concurrency)
        self.pool = EndpointPool(config.endpoints)
        self.client: ChatClient  # set in run()
        self._flush_now = asyncio.Event()
        self._changed = asyncio.Event()
        self._killed = False
        self._lock_file = None
        self._models = {ep.label: ep.model for ep in config.endpoints}

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        for event in self.snapshot():
            sub.put(event)
        self._subscribers.add(sub)
        return sub

    def publish(self, event: Event) -> None:
        if isinstance(event, LogEvent):
            self._log_tail = (self._log_tail + [event])[-200:]
        for sub in list(self._subscribers):
            sub.put(event)

    def log(self, level: str, message: str, dataset: str | None = None) -> None:
        self.publish(LogEvent(level, self.redact(message), dataset))

    def snapshot(self) -> list[Event]:
        events: list[Event] = list(self.stage_states.values())
        events += [runner.progress() for runner in self.runners.values()]
        events += self.endpoint_stats()
        events += self._telemetry.values()
        events += self._log_tail[-50:]
        return events

    def endpoint_stats(self) -> list[EndpointStats]:
        stats = []
        for ep in self.pool.endpoints:
            lat = sorted(ep.latencies)
            req_s, tok_s = ep.meter.rates()
            stats.append(
                EndpointStats(
                    url=ep.config.label,
                    in_flight=ep.in_flight,
                    requests=ep.requests,
                    errors=ep.errors,
                    req_per_s=round(req_s, 3),
                    tok_per_s=round(tok_s, 1),
                    latency_p50_s=round(lat[len(lat) // 2], 4) if lat else None,
                    latency_p95_s=round(lat[min(len(lat) - 1, int(len(lat) * 0.95))], 4) if lat else None,
                )
            )
        return stats

    def model_for(self, label: str) -> str:
        return self._models.get(label, "")

    # ---- commands -----------------------------------------------------------------------------
    async def execute(self, command: Command) -> Ack:
        if command.dataset in STAGES and command.dataset not in self.runners:
            ack = self._stage_command(command)
            self.log("info" if ack.ok else "warning", f"command {command.kind} {command.dataset}: {ack.message}")
            return ack
        if command.dataset is None and self._stage_ctx is not None and isinstance(command, (Pause, Resume)):
            self._stage_command(type(command)(self._stage_ctx.stage))
        targets = self._targets(command.dataset)
        if targets is None:
            return Ack(False, f"no dataset named {command.dataset!r} (have: {', '.join(self.runners)})")
        what = command.dataset or "all datasets"
        if isinstance(command, Pause):
            for r in targets:
                r.paused = True
                r.wake()
                if not r.state.terminal:
                    r._set(DatasetState.PAUSED)
            ack = Ack(True, f"paused {what}: no new requests, in-flight ones finish")
        elif isinstance(command, Resume):
            restarted = []
            for r in targets:
                r.paused = False
                r.wake()
                if r.state == DatasetState.PAUSED and r.task is not None and not r.task.done():
                    r._set(DatasetState.RUNNING)
                stopped_early = r.state == DatasetState.DONE and r.reason.startswith("budget")
                if (r.state == DatasetState.KILLED or stopped_early) and not self._killed and not r.at_limit():
                    self._start(r)
                    restarted.append(r.config.name)
            ack = Ack(True, f"resumed {what}" + (f" (restarted {', '.join(restarted)})" if restarted else ""))
        elif isinstance(command, Kill):
            if command.dataset is None:
                self.kill()
                ack = Ack(True, "killing the run: in-flight requests cancelled, finished work kept")
            else:
                runner = targets[0]
                await self._kill_runner(runner)
                ack = Ack(True, f"killed {runner.config.name}: in-flight requests cancelled, finished work kept")
        elif isinstance(command, SetBudget):
            runner = targets[0]
            ack = await self._set_budget(runner, command.tokens)
        else:  # pragma: no cover - command_from_json only builds the four
            ack = Ack(False, f"unknown command {command!r}")
        self.log("info" if ack.ok else "warning", f"command {command.kind} {command.dataset or '*'}: {ack.message}", command.dataset)
        return ack

    def _stage_command(self, command: Command) -> Ack:
        ctx = self._stage_ctx
        if ctx is None or ctx.stage != command.dataset:
            running = ctx.stage if ctx is not None else "none"
            return Ack(False, f"stage {command.dataset} is not running (running: {running})")
        if isinstance(command, Pause):
            ctx.pause()
            self._set_stage(ctx.stage, StageStatus.PAUSED, "pauses at its next batch")
            return Ack(True, f"paused {ctx.stage} (at its next batch boundary)")
        if isinstance(command, Resume):
            ctx.resume()
            self._set_stage(ctx.stage, StageStatus.RUNNING)
            return Ack(True, f"resumed {ctx.stage}")
        if isinstance(command, Kill):
            self.kill()
            return Ack(True, f"killing {ctx.stage}: it stops at its next batch, its work so far kept")
        return Ack(False, f"{command.kind} does not apply to a stage")

    def _targets(self, name: str | None) -> list[DatasetRunner] | None:
        if name is None:
            return list(self.runners.values())
        runner = self.runners.get(name)
        return [runner] if runner else None

    async def _set_budget(self, runner: DatasetRunner, tokens: int) -> Ack:
        old = runner.budget
        runner.budget = tokens
        runner.store.budget_override = tokens
        await self.flush_store(runner.store, force_manifest=True)
        runner.wake()
        note = ""
        if tokens > old and runner.state == DatasetState.DONE and not runner.at_limit() and not self._killed:
            if runner.reason.startswith("budget"):
                runner.reason = ""
                self._start(runner)
                note = "; dataset resumed"
        elif tokens < old and runner.in_flight:
            if self.config.cancel_in_flight_over_budget and runner.store.accepted.tokens >= tokens:
                runner.cancel_requests()
                note = f"; cancelled {runner.in_flight} in flight"
            else:
                note = f"; no new requests, {runner.in_flight} in flight finish"
        self.publish(runner.progress())
        return Ack(True, f"budget {runner.config.name}: {format_tokens(old)} -> {format_tokens(tokens)}{note}")

    async def _kill_runner(self, runner: DatasetRunner) -> None:
        task = runner.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def kill(self) -> None:
        """Stop everything now (Ctrl-C): cancel in-flight requests, keep finished work."""
        if self._killed:
            return
        self._killed = True
        if self._stage_ctx is not None:
            self._stage_ctx.kill()
        for runner in self.runners.values():
            if runner.task is not None and not runner.task.done():
                runner.task.cancel()
        self._changed.set()

    # ---- lifecycle ----------------------------------------------------------------------------
    def _start(self, runner: DatasetRunner) -> None:
        runner.task = asyncio.create_task(self._run_runner(runner), name=f"dataset:{runner.config.name}")

    async def _run_runner(self, runner: DatasetRunner) -> None:
        try:
            await runner.run()
        except asyncio.CancelledError:
            runner._finish(DatasetState.KILLED, "killed; resumable")
            # Swallow: a killed dataset is a state, not an error of the engine.
        except Exception as exc:  # noqa: BLE001 - a broken dataset must not take the others down
            runner._finish(DatasetState.FAILED, self.redact(f"{type(exc).__name__}: {exc}"))
        finally:
            self._changed.set()

    def request_flush(self) -> None:
        self._flush_now.set()

    async def flush_store(self, store: DatasetStore, *, force_manifest: bool = False) -> None:
        try:
            await store.flush(force_manifest=force_manifest)
        except OSError as exc:
            self.log("error", f"{store.directory}: write failed: {exc}", store.name)
            raise

    async def _flusher(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), self.config.flush_interval_s)
            self._flush_now.clear()
            for runner in self.runners.values():
                if runner.store.buffered():
                    await self.flush_store(runner.store)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            for runner in self.runners.values():
                self.publish(runner.progress())
            for stats in self.endpoint_stats():
                self.publish(stats)

    async def _telemetry_loop(self, session: aiohttp.ClientSession) -> None:
        """GPUs and host every tick; servers' /metrics every few ticks. Never on the event loop's
        critical path: NVML and psutil run in a thread, scrapes are plain async requests."""
        previous: dict[str, object] = {}
        tick = 0
        while True:
            try:
                gpu = await asyncio.to_thread(self.gpu_reader.read)
                host = await asyncio.to_thread(read_host)
            except Exception as exc:  # noqa: BLE001 - telemetry must never stop a run
                self.log("warning", f"telemetry: {type(exc).__name__}: {exc}")
            else:
                for event in (gpu, host):
                    self._telemetry[event.kind] = event
                    self.publish(event)
            if tick % 3 == 0:
                for ep in self.config.endpoints:
                    values = await scrape_metrics(session, ep.base_url)
                    if values is None:
                        continue
                    metrics, previous[ep.label] = server_metrics(ep.label, values, previous.get(ep.label), time.monotonic())
                    self._telemetry[f"server:{ep.label}"] = metrics
                    self.publish(metrics)
            tick += 1
            await asyncio.sleep(self.telemetry_interval_s)

    def _lock_output(self) -> None:
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.config.output_dir / ".lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise EngineError(f"{self.config.output_dir}: another eagleops run is using this output directory") from None
        lock.write(f"{os.getpid()}\n")
        lock.flush()
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
                self.log("info", f"{ds.name}: budget {format_tokens(store.budget_override)} (set live; run file says {format_tokens(ds.token_budget)})", ds.name)

    async def run(self) -> RunSummary:
        if self._lock_file is None:
            await self.open()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            telemetry = asyncio.create_task(self._telemetry_loop(session), name="telemetry")
            try:
                if "generate" in self.stages:
                    await self._generate(session)
                for name in self.stages:
                    if name == "generate":
                        continue
                    if self._killed or self._stage_failed():
                        break
                    await self._compute_stage(name)
            finally:
                telemetry.cancel()
                await asyncio.gather(telemetry, return_exceptions=True)
        for event in self.endpoint_stats():
            self.publish(event)
        for sub in list(self._subscribers):
            sub.put(None)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        return RunSummary([r.progress() for r in self.runners.values()], self._killed, {k: v.status for k, v in self.stage_states.items()})

    def _stage_failed(self) -> bool:
        return any(state.status == StageStatus.FAILED for state in self.stage_states.values())

    def _set_stage(self, name: str, status: StageStatus, detail: str = "") -> None:
        self.stage_states[name] = StageState(name, status, detail)
        self.publish(self.stage_states[name])

    async def _generate(self, session: aiohttp.ClientSession) -> None:
        self.client = ChatClient(session, self.pool, self.config.sampling, self.config.retry, TokenCounter(self.config.tokenizer))
        self.client.on_retry = lambda reason, delay: self.log("warning", f"retry in {delay:.1f}s: {reason}")
        self._set_stage("generate", StageStatus.RUNNING)
        helpers = [asyncio.create_task(self._flusher(), name="flusher"), asyncio.create_task(self._ticker(), name="ticker")]
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
                await asyncio.shield(self.flush_store(runner.store, force_manifest=True))
        for event in [*(r.progress() for r in self.runners.values()), *self.endpoint_stats()]:
            self.publish(event)  # the final numbers, with nothing left in flight
        states = [r.state for r in self.runners.values()]
        if self._killed:
            self._set_stage("generate", StageStatus.KILLED)
        elif DatasetState.FAILED in states:
            self._set_stage("generate", StageStatus.FAILED, "a dataset failed")
        else:
            self._set_stage("generate", StageStatus.DONE)

    async def _compute_stage(self, name: str) -> None:
        """A torch stage in a worker thread; its events cross back to the loop thread-safely."""
        from .stages import stage_functions

        loop = asyncio.get_running_loop()
        ctx = StageContext(name, lambda event: loop.call_soon_threadsafe(self.publish, event))
        self._stage_ctx = ctx
        self._set_stage(name, StageStatus.RUNNING)
        try:
            result = await asyncio.to_thread(stage_functions()[name], self.config, ctx)
        except StageKilled:
            self._set_stage(name, StageStatus.KILLED, "killed; resumable")
        except Exception as exc:  # noqa: BLE001 - a failed stage is reported, the run stops cleanly
            self.log("error", self.redact(f"{name}: {type(exc).__name__}: {exc}"))
            self._set_stage(name, StageStatus.FAILED, self.redact(str(exc))[:200])
        else:
            self.stage_results[name] = result
            self._set_stage(name, StageStatus.DONE)
        finally:
            self._stage_ctx = None
