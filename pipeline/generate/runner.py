"""One dataset of the generate stage: reads its source from the resume point, admits requests
while its limits have room, records every outcome in its crash-safe store, and takes the
dataset's commands (pause, resume, budget, kill)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagleops.pipeline.config import DatasetConfig, field_map, format_tokens
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.generate.client import ChatClient, Completion, PermanentFailure, RateMeter
from eagleops.pipeline.generate.conversation import regenerate
from eagleops.pipeline.generate.digest import CURRENT_REQUEST, FailureDigest
from eagleops.pipeline.generate.fit import PromptFit, Skipped
from eagleops.pipeline.generate.limits import Admission, Conversation, Limits
from eagleops.pipeline.generate.records import bad_line_record, failed_request_record, generated_record, skipped_record
from eagleops.pipeline.generate.store import DatasetStore, SaveRetry, StoreError, WriteFailed
from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, StopReason
from eagleops.pipeline.protocol.host import StageHost
from eagleops.pipeline.protocol.redact import Redactor
from eagleops.pipeline.sources import BadLine, Prompt, SourceReader, reply_points

__all__ = ["DatasetRunner", "RunnerShared"]

FLUSH_RECORDS = 256  # buffered records that trigger a flush before the interval is up
_READ_BATCH = 256


@dataclass
class RunnerShared:
    """What every dataset shares: the host, the client, the slots capping requests in flight."""

    host: StageHost
    clock: Callable[[], float]
    redact: Redactor
    redact_data: Redactor  # for generated text: only keys long enough to be real
    slots: asyncio.Semaphore
    request_flush: Callable[[], None]
    cancel_over_budget: bool = False
    models: dict[str, str] = field(default_factory=dict)  # endpoint label -> model name
    client: ChatClient | None = None  # set when the stage runs
    failures: FailureDigest | None = None  # permanent failures past each dataset's first few; set when the stage runs
    fit: PromptFit | None = None  # with [target]: what a prompt may take so that its reply is trained

    def chat(self) -> ChatClient:
        if self.client is None:
            raise RuntimeError("the generate stage has not started its client")
        return self.client


class DatasetRunner:
    def __init__(self, shared: RunnerShared, config: DatasetConfig, store: DatasetStore, *, thinking: str, max_tokens: int):
        self.shared, self.config, self.store = shared, config, store
        # what may go out: the limits, and the reservations of what is in flight
        self.admission = Admission(Limits(store.budget, config.max_samples, max_tokens), regenerate_all=config.regenerate == "all")
        self.thinking = thinking
        self.state, self.reason = DatasetState.QUEUED, ""
        self.stopped_by: StopReason | None = None
        self.paused = False
        self.meter = RateMeter(clock=shared.clock)
        self.task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._exhausted = False
        self.saving = SaveRetry()  # failed saves in a row, until one succeeds
        self._stopping = False  # killed: the final save stops waiting for a full disk
        self.source_meter = RateMeter(clock=shared.clock)  # source bytes finished per second
        self._source_size = 0
        self.fields = field_map(config.format, config.fields, config.id_field)
        self.latencies: deque[float] = deque(maxlen=2000)  # this session's, for the detail view
        self.endpoint_counts: Counter[str] = Counter()

    @property
    def budget(self) -> int:
        return self.admission.budget

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def _room(self) -> bool:
        done = self.store.accepted
        return self.admission.room(done.tokens, done.samples)

    def limit_reached(self) -> StopReason | None:
        done = self.store.accepted
        return self.admission.reached(done.tokens, done.samples)

    def wake(self) -> None:
        self._wake.set()

    async def _wait(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _log(self, level: str, message: str) -> None:
        self.shared.host.log(level, message, self.config.name)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, on_end: Callable[[], None]) -> None:
        self.task = asyncio.create_task(self._run_guarded(on_end), name=f"dataset:{self.config.name}")

    async def _run_guarded(self, on_end: Callable[[], None]) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            self._finish(DatasetState.KILLED, StopReason.KILLED)
            # Swallow: a killed dataset is a state, not an error of the engine.
        except Exception as exc:
            self._finish(DatasetState.FAILED, StopReason.FAILED, self.shared.redact(f"{type(exc).__name__}: {exc}"))
        finally:
            on_end()

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> None:
        self._stopping = False
        with contextlib.suppress(OSError, InputError):  # the ETA's cap: the source's bytes left
            self._source_size = await asyncio.to_thread(self.store.source.seekable_size)
        self.store.rewind_to_watermark()
        self._exhausted = False
        self.reason, self.stopped_by = "", None
        if (limit := self.limit_reached()) is not None:
            self._finish(DatasetState.DONE, limit)
            return
        self._set(DatasetState.PAUSED if self.paused else DatasetState.RUNNING)
        failure: str | None = None
        try:
            async with asyncio.TaskGroup() as group:
                await self._issue(group)
        except* (StoreError, InputError) as errors:  # their own words name the file
            failure = str(errors.exceptions[0])
        except* OSError as errors:
            failure = f"{self.config.path}: {errors.exceptions[0]}"
        finally:
            await asyncio.shield(self._save_before_finishing())
        if failure is not None:
            self._finish(DatasetState.FAILED, StopReason.FAILED, failure)
            return
        if (limit := self.limit_reached()) is not None:
            self._finish(DatasetState.DONE, limit)
        elif self._exhausted:
            self._finish(DatasetState.DONE, StopReason.SOURCE_EXHAUSTED)
        else:
            self._finish(DatasetState.DONE, StopReason.STOPPED)

    async def _issue(self, group: asyncio.TaskGroup) -> None:
        offset, lines = self.store.reader_position()
        reader = SourceReader(self.store.source, self.fields, offset=offset, line=lines, regenerate=self.config.regenerate)
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
                    mine = self.admission.begin(len(reply_points(item.messages)) if self.admission.regenerate_all else 1)
                    task = group.create_task(self._request(item, mine), name=f"{self.config.name}:{item.prompt_id}")
                    self._requests.add(task)
                    # a callback, not a finally: it runs for a task cancelled before it started too
                    task.add_done_callback(functools.partial(self._request_ended, mine=mine))
                self.store.advanced(item.end, item.line)

    async def _admit(self) -> bool:
        """Wait for a slot; False once this dataset should stop issuing (budget or cap reached)."""
        slots = self.shared.slots
        while True:
            if self.paused or self.storage_error is not None:
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
            if self.paused or self.storage_error is not None or not self._room():
                slots.release()
                continue
            return True

    def _bad_line(self, item: BadLine) -> None:
        self.store.dispatched(item)
        self.store.add_failure(item, self.shared.redact_data.scrub(bad_line_record(item, self.config.name)))
        self._log("error", item.message)

    async def _request(self, prompt: Prompt, mine: Conversation) -> None:
        CURRENT_REQUEST.set((self.config.name, prompt.prompt_id))  # this task's own context: names its retries
        try:
            client = self.shared.chat()
            conversation, completion, written, dropped = await regenerate(
                client, prompt, self.config, self.thinking, self.shared.fit,
                may_go_on=lambda: self.admission.may_go_on(self.store.accepted.tokens), on_reply=lambda reply: self.admission.flight.replied(mine, reply.completion_tokens),
            )  # fmt: skip
            self.store.add_record(prompt, self._record(prompt, conversation, completion, written, dropped), completion.captured_replies())
        except Skipped as exc:  # the first says so in the log; the count is in the progress and the detail
            self.store.add_failure(prompt, skipped_record(prompt, self.config.name, exc.reason))
            if self.store.accepted.skipped == 1:
                self._log("warning", f"{self.config.name}: skipped {prompt.prompt_id} unsent, and will skip any like it: {exc.reason}")
        except PermanentFailure as exc:
            self._request_failed(prompt, exc.reason, exc.attempts)
        except Exception as exc:  # whatever it is, it is this row's: recorded, and the dataset goes on
            self._request_failed(prompt, f"{type(exc).__name__}: {exc}", None)
        else:
            self.meter.add(completion.completion_tokens)
            self.latencies.append(completion.latency_s)
            self.endpoint_counts[completion.endpoint] += 1
            if self.shared.cancel_over_budget and self.store.accepted.tokens >= self.budget:
                self.cancel_requests()
        finally:
            self.source_meter.add(prompt.end - prompt.offset)

    def _request_ended(self, task: asyncio.Task, *, mine: Conversation) -> None:
        """Whatever became of a request (even cancelled before it ran): its slot and reservations go back."""
        self._requests.discard(task)
        self.admission.end(mine)
        self.shared.slots.release()
        self.wake()
        if self.store.buffered() >= FLUSH_RECORDS:
            self.shared.request_flush()

    def _request_failed(self, prompt: Prompt, reason: str, attempts: int | None) -> None:
        reason = self.shared.redact(reason).encode("utf-8", "backslashreplace").decode("utf-8")
        self.store.add_failure(prompt, failed_request_record(prompt, self.config.name, reason, attempts))
        where = f"{prompt.shard or self.config.path.name}:{prompt.line} ({prompt.prompt_id})"
        (self.shared.failures or FailureDigest(self.shared.host.log)).failed(self.config.name, where, reason)

    def _record(
        self, prompt: Prompt, conversation: list[dict[str, Any]], completion: Completion, written: list[int], dropped: int
    ) -> dict[str, Any]:
        model, name = self.shared.models.get(completion.endpoint, ""), self.config.name
        record = generated_record(prompt, name, conversation, completion, written, model=model, thinking=self.thinking, dropped=dropped)
        return self.shared.redact_data.scrub(record)

    def stop(self) -> None:
        """Kill this dataset: in-flight requests cancelled, finished work kept (resumable)."""
        if self.task is not None and not self.task.done():
            self._stopping = True
            self.task.cancel()
            self.wake()

    async def kill(self) -> None:
        task = self.task
        if task is not None and not task.done():
            self.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def cancel_requests(self) -> None:
        for task in list(self._requests):
            task.cancel()

    # ---- commands -----------------------------------------------------------------------------
    def pause(self) -> None:
        self.paused = True
        self.wake()
        if not self.state.terminal:
            self._set(DatasetState.PAUSED)

    def resume(self) -> bool:
        """Issue again; True when the dataset ended and should start again (killed, or stopped by a limit since raised)."""
        self.paused = False
        self.wake()
        if self.state == DatasetState.PAUSED and self.task is not None and not self.task.done():
            for meter in (self.meter, self.source_meter):  # its rate and ETA from now, not averaged with the pause
                meter.restart()
            self._set(DatasetState.RUNNING)
        stopped_early = self.state == DatasetState.KILLED or (self.state == DatasetState.DONE and self.stopped_by == StopReason.BUDGET)
        return stopped_early and self.limit_reached() is None

    async def set_budget(self, tokens: int) -> tuple[str, bool]:
        """The new budget, made durable at once. Answers what became of it in words, and whether
        the dataset, stopped by its old budget, should be started again."""
        old = self.budget
        self.admission.limits.budget.live = tokens
        saved = await self.save(force_manifest=True)
        self.wake()
        note = "" if saved else f" (not saved yet: {self.storage_error})"
        restart = False
        if tokens > old and self.state == DatasetState.DONE and self.stopped_by == StopReason.BUDGET and self.limit_reached() is None:
            restart = True
        elif tokens < old and self.in_flight:
            if self.shared.cancel_over_budget and self.store.accepted.tokens >= tokens:
                self.cancel_requests()
                note += f"; cancelled {self.in_flight} in flight"
            else:  # without room, what is done and in flight already fills the new budget
                note += f"; no new requests: it finishes its {self.in_flight} in flight, then stops" if not self._room() else "; it goes on"
        self.shared.host.publish(self.progress())
        return f"budget {self.config.name}: {format_tokens(old)} -> {format_tokens(tokens)}{note}", restart

    # ---- storage ------------------------------------------------------------------------------
    async def save(self, *, force_manifest: bool = False) -> bool:
        """Make this dataset's finished records durable. A failed write pauses the dataset (its
        records stay in memory) until a later try, with backoff, succeeds."""
        try:
            await self.store.flush(force_manifest=force_manifest)
        except WriteFailed as exc:
            self._storage_failed(self.shared.redact(str(exc)))
            return False
        if self.storage_error is not None:
            self._storage_recovered()
        return True

    @property
    def storage_error(self) -> str | None:
        """Why the last save failed, until one succeeds."""
        return self.saving.error

    def _storage_failed(self, message: str) -> None:
        """A save failed: stop issuing (what is in flight finishes into memory) and retry later."""
        if self.saving.failed(message, self.shared.clock()):
            held = self.store.buffered()
            self._log("error", f"{self.config.name}: cannot save: {message}; paused with {held} finished records in memory, retrying")
        if not self.state.terminal:
            self.reason = f"cannot save: {message}"
            self.state = DatasetState.PAUSED
            self.shared.host.publish(self.progress())

    def _storage_recovered(self) -> None:
        self._log("info", f"{self.config.name}: saving again after {self.saving.reset()} failed tries; resumed")
        if not self.state.terminal:
            self.reason = ""
            self._set(DatasetState.PAUSED if self.paused else DatasetState.RUNNING)
        self.wake()

    def storage_retry_due(self) -> bool:
        return self.saving.due(self.shared.clock())

    async def _save_before_finishing(self) -> None:
        """Everything this dataset finished is saved before it ends, however long the disk
        stays full; a kill ends the wait (the unsaved records are made again on resume)."""
        while not await self.save(force_manifest=True):
            if self._stopping:
                if dropped := self.store.discard_unsaved():
                    self._log("error", f"{self.config.name}: {dropped} finished records not saved; a resume makes them again")
                self.saving.reset()  # nothing left to save: a restart tries the disk afresh
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait(), max(0.05, self.saving.retry_at - self.shared.clock()))

    # ---- state --------------------------------------------------------------------------------
    def _set(self, state: DatasetState) -> None:
        if state != self.state:
            self.state = state
            self.shared.host.publish(self.progress())

    def _finish(self, state: DatasetState, stop: StopReason, detail: str = "") -> None:
        reason = detail or stop.value
        if state == DatasetState.DONE and self.store.accepted.tokens > self.budget:
            reason += f", overshoot {format_tokens(self.store.accepted.tokens - self.budget)} tokens"
        self.state, self.reason, self.stopped_by = state, reason, stop
        self.shared.host.publish(self.progress())
        level = "error" if state == DatasetState.FAILED else "info"
        self._log(level, f"{self.config.name}: {state.value} ({reason})")

    def progress(self) -> DatasetProgress:
        totals = self.store.accepted
        req_s, tok_s = self.meter.rates() if not self.state.terminal else (0.0, 0.0)  # a stopped dataset makes nothing
        remaining = self.budget - totals.tokens
        eta = remaining / tok_s if (tok_s > 0 and remaining > 0 and self.state == DatasetState.RUNNING) else None
        _, bytes_s = self.source_meter.rates()
        if eta is not None and bytes_s > 0 and self._source_size:  # the source may run out before the budget does
            eta = min(eta, max(0, self._source_size - self.store.done_offset()) / bytes_s)
        return DatasetProgress(
            name=self.config.name,
            state=self.state,
            tokens=totals.tokens,
            budget=self.budget,
            samples=totals.samples,
            in_flight=self.in_flight,
            failures=totals.failures,
            skipped=totals.skipped,
            bad_lines=totals.bad_lines,
            truncated=totals.truncated,
            max_samples=self.config.max_samples,
            req_per_s=round(req_s, 3),
            tok_per_s=round(tok_s, 1),
            eta_s=round(eta, 1) if eta is not None else None,
            cost=round(totals.cost, 6),
            reasoning_tokens=totals.reasoning_tokens,
            reason=self.reason,
            stopped_by=self.stopped_by if self.state.terminal else None,
            **self.store.captured(),
        )
