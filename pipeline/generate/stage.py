"""The generate stage: every dataset's runner, the slots that cap requests in flight across
them, one flusher that makes finished records durable in batches, one ticker that publishes
progress, and vLLM serving the target while the stage runs (``[serve]``).

Everything that decides what to send and when to stop lives here; the engine hosts the stage
(``StageHost``) and forwards the dataset commands. Commands only flip state and wake runners;
kill cancels tasks, which closes their HTTP connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from eagleops.pipeline.config import EndpointConfig, RunConfig, format_tokens
from eagleops.pipeline.errors import EagleOpsError, InputError
from eagleops.pipeline.generate.capture import CapturePlan, ServedCapture
from eagleops.pipeline.generate.client import ChatClient, EndpointPool, TokenCounter
from eagleops.pipeline.generate.detail import dataset_detail, failure_reasons
from eagleops.pipeline.generate.digest import FailureDigest, RetryDigest
from eagleops.pipeline.generate.endpoints import connection_limit
from eagleops.pipeline.generate.limits import Budget
from eagleops.pipeline.generate.runner import DatasetRunner, RunnerShared
from eagleops.pipeline.generate.store import DatasetStore
from eagleops.pipeline.protocol.events import Ack, Command, DatasetState, EndpointStats, Kill, Pause, Resume, SetBudget, StageStatus
from eagleops.pipeline.protocol.host import StageHost
from eagleops.pipeline.protocol.redact import Redactor
from eagleops.pipeline.servers.supervisor import SupervisedServer
from eagleops.pipeline.sources import Source

__all__ = ["GenerateStage"]

STAGE = "generate"


class GenerateStage:
    def __init__(self, config: RunConfig, host: StageHost, *, clock: Callable[[], float], progress_interval_s: float = 1.0):
        self.config, self.host, self.progress_interval_s = config, host, progress_interval_s
        self.runners: dict[str, DatasetRunner] = {}
        self.pool = self._pool(config.endpoints)
        self.shared = RunnerShared(
            host=host,
            clock=clock,
            redact=Redactor(config.secrets()),
            # generated text is rewritten only for keys long enough to be real: a placeholder key such
            # as vLLM's usual "EMPTY" must not turn every "EMPTY" the target writes into ***
            redact_data=Redactor(config.secrets(), min_length=16),
            slots=asyncio.Semaphore(config.concurrency),
            request_flush=self.request_flush,
            cancel_over_budget=config.cancel_in_flight_over_budget,
            models={ep.label: ep.model for ep in config.endpoints},
        )
        self._flush_now = asyncio.Event()
        self._changed = asyncio.Event()
        self._killed = False
        self._served: SupervisedServer | None = None  # vLLM serving the target, while it does
        self.capture_plan: CapturePlan | None = None  # with during_generate: the served target captures
        self._capturing: str | None = None  # the label of the endpoint that captures
        self._served_failure: str | None = None

    def _pool(self, endpoints: tuple[EndpointConfig, ...]) -> EndpointPool:
        bench = (max(0.05, self.config.retry.base_delay_s), max(0.05, self.config.retry.max_delay_s))
        return EndpointPool(endpoints, base_bench_s=bench[0], max_bench_s=bench[1])

    def endpoint_stats(self, *, ended: bool = False) -> list[EndpointStats]:
        return self.pool.stats(ended=ended)

    def endpoints(self) -> list[EndpointConfig]:
        """Where generation sends requests now (a served target joins while it serves)."""
        return [state.config for state in self.pool.endpoints]

    def request_flush(self) -> None:
        self._flush_now.set()

    # ---- opening ------------------------------------------------------------------------------
    async def open(self) -> None:
        """Recover every dataset's store (O(1) per dataset). Raises StoreError or OSError."""
        for i, ds in enumerate(self.config.datasets):
            source = Source(ds.path, ds.split)
            try:  # a path that names no data fails the run before any request, as a run file's error
                await asyncio.to_thread(getattr, source, "shards")
            except InputError as exc:
                raise InputError(f"{self.config.source}: datasets[{i}].path: {exc}") from None
            store = DatasetStore(self.config.layout.dataset(ds.name).dir, ds.name, source, Budget(ds.token_budget))
            await asyncio.to_thread(store.open)
            thinking = self.config.thinking_for(ds)
            self.runners[ds.name] = DatasetRunner(self.shared, ds, store, thinking=thinking, max_tokens=self.config.sampling.max_tokens)
            if store.recovered_records or store.repaired_bytes:
                self.host.log(
                    "warning",
                    f"{ds.name}: recovered {store.recovered_records} records written after the last manifest"
                    + (f", truncated a torn {store.repaired_bytes}-byte tail" if store.repaired_bytes else ""),
                    ds.name,
                )
            if store.budget.live is not None and store.budget.live != ds.token_budget:
                self.host.log(
                    "info",
                    f"{ds.name}: budget {format_tokens(store.budget.live)} (set live; run file says {format_tokens(ds.token_budget)})",
                    ds.name,
                )

    # ---- running ------------------------------------------------------------------------------
    async def run(self) -> None:
        connections, warning = connection_limit(self.config.concurrency, len(self.config.datasets))
        if warning is not None:  # fewer requests in flight, so none waits for a connection on its timeout
            self.host.log("warning", warning)
            self.shared.slots = asyncio.Semaphore(connections)
        # idle connections are dropped before vLLM's and SGLang's uvicorn drops them (5 s): one
        # reused as the server closes it fails the request sent on it (aiohttp keeps them 15 s)
        connector = aiohttp.TCPConnector(limit=connections, ttl_dns_cache=300, enable_cleanup_closed=True, keepalive_timeout=4.0)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            try:
                async with self._served_target():
                    await self._generate(session)
            except EagleOpsError as exc:  # the served target did not start (or cannot be found)
                if self._killed:
                    self.host.set_stage(STAGE, StageStatus.KILLED)
                    return
                message = self.shared.redact(str(exc))
                self.host.log("error", message)
                self.host.set_stage(STAGE, StageStatus.FAILED, message[:200])
                return
        if self._served_failure is not None:
            self.host.set_stage(STAGE, StageStatus.FAILED, self._served_failure[:200])

    @contextlib.asynccontextmanager
    async def _served_target(self) -> AsyncIterator[None]:
        """With [serve]: vLLM serves the target as one more endpoint while generate runs."""
        serve = self.config.serve
        if serve is None or not serve.for_generate:
            yield
            return
        from eagleops.pipeline.servers.vllm import launch_for, vllm_server, with_capture_extension

        loop = asyncio.get_running_loop()
        launch = launch_for(self.config)
        plan = self.capture_plan
        if plan is not None:  # the hidden states of every reply, kept as it is generated
            launch = with_capture_extension(launch, self.config.layout.capture_extension)
            if plan.multimodal:  # served whole, vLLM feeds it embeddings, not the ids its rows are given back by
                launch = dataclasses.replace(launch, extra_args=(*launch.extra_args, "--language-model-only"))
        log_path = self.config.layout.server_log("vllm-generate")
        server = vllm_server(launch, log_path=log_path, log=lambda level, message: loop.call_soon_threadsafe(self.host.log, level, message),
                             startup_timeout_s=serve.startup_timeout_s, max_restarts=serve.max_restarts,
                             on_failed=lambda reason: loop.call_soon_threadsafe(self._served_target_gone, reason))  # fmt: skip
        self._served = server
        self.host.set_stage(STAGE, StageStatus.RUNNING, "starting vLLM")
        self.host.log(
            "info",
            f"vllm: starting {launch.model} (tp {launch.tensor_parallel_size}, pp {launch.pipeline_parallel_size}, dp {launch.data_parallel_size})",
        )
        try:
            await asyncio.to_thread(server.start)
            endpoint = EndpointConfig(base_url=f"{server.base_url}/v1", model=launch.served_name, kind="vllm")
            if plan is not None:
                warn = lambda message: loop.call_soon_threadsafe(self.host.log, "warning", message)  # noqa: E731  (from the saving thread)
                capture = ServedCapture(server.base_url, log_path, plan.layers, on_problem=warn)
                capture.limit_bytes = int(self.config.extract.max_cache_gb * 1e9)
                capture.taken_bytes = sum(runner.store.captured_bytes for runner in self.runners.values())
                await asyncio.to_thread(capture.start)
                for runner in self.runners.values():
                    runner.store.capture = capture
                self._capturing = endpoint.label
                self.host.log("info", f"extract during generate: vLLM keeps layers {list(plan.layers)} + final of every reply")
            self.pool = self._pool((*self.config.endpoints, endpoint))
            self.shared.models[endpoint.label] = endpoint.model
            yield
        finally:
            await asyncio.to_thread(server.stop)
            self._served = None

    def _served_target_gone(self, reason: str) -> None:
        """vLLM died more often than it may be restarted: stop generate (resumable), mark it failed."""
        self._served_failure = reason
        for runner in self.runners.values():
            runner.stop()

    def _start_client(self, session: aiohttp.ClientSession, digest: RetryDigest) -> None:
        client = ChatClient(
            session, self.pool, self.config.sampling, self.config.retry, TokenCounter(self.config.tokenizer), redact=self.shared.redact
        )
        client.capturing = self._capturing
        client.on_retry = lambda endpoint, reason, delay: digest.note(endpoint, reason)
        client.on_warning = lambda message: self.host.log("warning", message)
        self.pool.on_health = self.host.log
        self.shared.client = client

    async def _generate(self, session: aiohttp.ClientSession) -> None:
        digest = RetryDigest(self.host.log, self.config.retry_log_interval_s)
        failures = self.shared.failures = FailureDigest(self.host.log, self.config.retry_log_interval_s)
        self._start_client(session, digest)
        self.host.set_stage(STAGE, StageStatus.RUNNING)
        helpers = [
            asyncio.create_task(coro, name=name)
            for coro, name in (
                (self._flusher(), "flusher"), (self._ticker(), "ticker"), (digest.run(), "retry digest"), (failures.run(), "failure digest"),
            )
        ]  # fmt: skip
        try:
            for runner in self.runners.values():
                runner.start(self._changed.set)
            while any(r.task is not None and not r.task.done() for r in self.runners.values()):
                self._changed.clear()
                await self._changed.wait()
        finally:
            await self._wind_down(helpers)
        for event in [*(r.progress() for r in self.runners.values()), *self.endpoint_stats()]:
            self.host.publish(event)  # the final numbers, with nothing left in flight
        states = [r.state for r in self.runners.values()]
        if self._killed:
            self.host.set_stage(STAGE, StageStatus.KILLED)
        elif DatasetState.FAILED in states:
            self.host.set_stage(STAGE, StageStatus.FAILED, "a dataset failed")
        else:
            self.host.set_stage(STAGE, StageStatus.DONE)

    async def _wind_down(self, helpers: list[asyncio.Task]) -> None:
        """Every runner ended, the helpers stopped, and what is finished saved (or said lost)."""
        if any(r.task is not None and not r.task.done() for r in self.runners.values()):
            self.kill()
        for runner in self.runners.values():
            if runner.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await runner.task
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await self.pool.close()  # its /health probes of benched endpoints end with the stage
        for runner in self.runners.values():
            if not await asyncio.shield(runner.save(force_manifest=True)) and runner.store.buffered():
                self.host.log(
                    "error", f"{runner.config.name}: {runner.store.buffered()} finished records not saved; a resume makes them again"
                )

    async def _flusher(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), self.config.flush_interval_s)
            self._flush_now.clear()
            for runner in self.runners.values():
                if runner.store.unsaved() and runner.storage_retry_due():
                    await runner.save()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            for runner in self.runners.values():
                self.host.publish(runner.progress())
            for stats in self.endpoint_stats():
                self.host.publish(stats)

    def kill(self) -> None:
        """Stop now: cancel in-flight requests, keep finished work."""
        self._killed = True
        for runner in self.runners.values():
            runner.stop()
        if self._served is not None:  # a vLLM still loading would hold the kill for minutes
            threading.Thread(target=self._served.stop, name="stop-vllm", daemon=True).start()
        self._changed.set()

    # ---- the datasets' commands ---------------------------------------------------------------
    async def execute(self, command: Command) -> Ack:
        """Pause, resume, kill one dataset, or change its budget; ``dataset=None`` means all."""
        if command.dataset is None:
            targets = list(self.runners.values())
        elif (runner := self.runners.get(command.dataset)) is not None:
            targets = [runner]
        else:
            return Ack(False, f"no dataset named {command.dataset!r} (have: {', '.join(self.runners)})")
        what = command.dataset or "all datasets"
        if isinstance(command, Pause):
            for runner in targets:
                runner.pause()
            return Ack(True, f"paused {what}: no new requests, in-flight ones finish")
        if isinstance(command, Resume):
            restarted = [r.config.name for r in targets if r.resume() and self._restart(r)]
            return Ack(True, f"resumed {what}" + (f" (restarted {', '.join(restarted)})" if restarted else ""))
        if isinstance(command, Kill):  # of one dataset: the engine kills the whole run itself
            await targets[0].kill()
            return Ack(True, f"killed {targets[0].config.name}: in-flight requests cancelled, finished work kept")
        if isinstance(command, SetBudget):
            message, restart = await targets[0].set_budget(command.tokens)
            if restart and self._restart(targets[0]):
                message += "; dataset resumed"
            return Ack(True, message)
        return Ack(False, f"unknown command {command!r}")

    def _restart(self, runner: DatasetRunner) -> bool:
        if self._killed:
            return False
        runner.start(self._changed.set)
        return True

    async def detail(self, name: str) -> dict[str, Any]:
        """One dataset in detail (failures by reason from its failed.jsonl, latency, endpoints)."""
        runner = self.runners.get(name)
        if runner is None:
            return {"ok": False, "message": f"no dataset named {name!r} (have: {', '.join(self.runners)})"}
        detail = dataset_detail(runner)
        detail["failures"], detail["failures_partial"] = await asyncio.to_thread(failure_reasons, runner.store.failed_path)
        return {"ok": True, "detail": detail}
