"""One dataset of the generate stage: reads its source from the resume point, admits requests
while its token budget has room, records every outcome in its crash-safe store."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from pipeline.config import DatasetConfig, format_tokens
from pipeline.engine.digest import CURRENT_REQUEST
from pipeline.generate.client import Completion, PermanentFailure, RateMeter
from pipeline.generate.conversation import assistant_turn, regenerate_all
from pipeline.generate.sources import BadLine, Prompt, SourceReader
from pipeline.generate.store import DatasetStore, StoreError
from pipeline.protocol.events import DatasetProgress, DatasetState

if TYPE_CHECKING:
    from pipeline.engine.engine import Engine

__all__ = ["DatasetRunner"]

FLUSH_RECORDS = 256  # buffered records that trigger a flush before the interval is up
_STORAGE_RETRY_MAX_S = 15.0
_READ_BATCH = 256


class DatasetRunner:
    def __init__(self, engine: Engine, config: DatasetConfig, store: DatasetStore):
        self.engine, self.config, self.store = engine, config, store
        self.budget = store.budget_override if store.budget_override is not None else config.token_budget
        self.thinking = engine.config.thinking_for(config)
        self.state = DatasetState.QUEUED
        self.reason = ""
        self.paused = False
        self.in_flight = 0
        self.meter = RateMeter(clock=engine.clock)
        self.task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._exhausted = False
        self.storage_error: str | None = None  # why the last save failed, until one succeeds
        self._storage_failures = 0
        self._storage_retry_at = 0.0
        self._stopping = False  # killed: the final save stops waiting for a full disk
        self.source_meter = RateMeter(clock=engine.clock)  # source bytes finished per second
        self._source_size = 0
        self.latencies: deque[float] = deque(maxlen=2000)  # this session's, for the detail view
        self.endpoint_counts: Counter[str] = Counter()

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
        self._stopping = False
        with contextlib.suppress(OSError):
            self._source_size = (await asyncio.to_thread(self.config.path.stat)).st_size
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
            await asyncio.shield(self._save_before_finishing())
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
        reader = SourceReader(
            self.config.path, self.config.format, self.config.id_field, offset=offset, line=lines, regenerate=self.config.regenerate
        )
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
        self.store.add_failure(
            item,
            self.engine.redact_data.scrub(
                {
                    "id": f"line:{item.line}",
                    "kind": "bad_line",
                    "dataset": self.config.name,
                    "source_offset": item.offset,
                    "source_line": item.line,
                    "field": item.field,
                    "reason": item.message,
                }
            ),
        )
        self.engine.log("error", item.message, self.config.name)

    async def _request(self, prompt: Prompt) -> None:
        CURRENT_REQUEST.set((self.config.name, prompt.prompt_id))  # this task's own context: names its retries
        try:
            if self.config.regenerate == "all":
                conversation, completion, written = await regenerate_all(self.engine.client, prompt.messages, self.thinking)
            else:
                completion = await self.engine.client.complete(prompt.messages, thinking=self.thinking)
                conversation, written = [*prompt.messages, assistant_turn(completion)], [len(prompt.messages)]
            self.store.add_record(prompt, self.engine.redact_data.scrub(self._record(prompt, conversation, completion, written)))
        except PermanentFailure as exc:
            self._request_failed(prompt, exc.reason, exc.attempts)
        except Exception as exc:  # whatever it is, it is this row's: recorded, and the dataset goes on
            self._request_failed(prompt, f"{type(exc).__name__}: {exc}", None)
        else:
            self.meter.add(completion.completion_tokens)
            self.latencies.append(completion.latency_s)
            self.endpoint_counts[completion.endpoint] += 1
            if self.engine.config.cancel_in_flight_over_budget and self.store.accepted.tokens >= self.budget:
                self.cancel_requests()
        finally:
            self.source_meter.add(prompt.end - prompt.offset)
            self.in_flight -= 1
            self.engine.slots.release()
            self.wake()
            if self.store.buffered() >= FLUSH_RECORDS:
                self.engine.request_flush()

    def _request_failed(self, prompt: Prompt, reason: str, attempts: int | None) -> None:
        reason = self.engine.redact(reason).encode("utf-8", "backslashreplace").decode("utf-8")
        self.store.add_failure(
            prompt,
            {
                "id": prompt.prompt_id,
                "kind": "request",
                "dataset": self.config.name,
                "source_offset": prompt.offset,
                "source_line": prompt.line,
                "reason": reason,
                "attempts": attempts,
            },
        )
        self.engine.log("error", f"{self.config.path.name}:{prompt.line} ({prompt.prompt_id}): {reason}", self.config.name)

    def _record(self, prompt: Prompt, conversation: list[dict[str, Any]], completion: Completion, written: list[int]) -> dict[str, Any]:
        record = {
            "id": prompt.prompt_id,
            "conversations": conversation,
            "target_turns": written,  # the replies the target wrote: the only ones trained on
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
            "thinking": self.thinking,  # drop: the reasoning is kept here but not trained on
            "reasoning_tokens": completion.reasoning_tokens,
            "finished_at": round(time.time(), 3),
        }
        if completion.token_ids is not None:
            record["completion_token_ids"] = list(completion.token_ids)
        return record

    def stop(self) -> None:
        """Kill this dataset: in-flight requests cancelled, finished work kept (resumable)."""
        if self.task is not None and not self.task.done():
            self._stopping = True
            self.task.cancel()
            self.wake()

    def cancel_requests(self) -> None:
        for task in list(self._requests):
            task.cancel()

    # ---- storage faults ---------------------------------------------------------------------
    def storage_failed(self, message: str) -> None:
        """A save failed: stop issuing (what is in flight finishes into memory) and retry later."""
        self._storage_failures += 1
        self._storage_retry_at = self.engine.clock() + min(
            _STORAGE_RETRY_MAX_S, 0.25 * 2 ** min(self._storage_failures, 16)
        )  # (a float of 2**1024 overflows)
        if message != self.storage_error:
            self.engine.log(
                "error",
                f"{self.config.name}: cannot save: {message}; paused with {self.store.buffered()} finished records in memory, retrying",
                self.config.name,
            )
        self.storage_error = message
        if not self.state.terminal:
            self.reason = f"cannot save: {message}"
            self.state = DatasetState.PAUSED
            self.engine.publish(self.progress())

    def storage_recovered(self) -> None:
        self.engine.log("info", f"{self.config.name}: saving again after {self._storage_failures} failed tries; resumed", self.config.name)
        self.storage_error, self._storage_failures = None, 0
        if not self.state.terminal:
            self.reason = ""
            self._set(DatasetState.PAUSED if self.paused else DatasetState.RUNNING)
        self.wake()

    def storage_retry_due(self) -> bool:
        return self.storage_error is None or self.engine.clock() >= self._storage_retry_at

    async def _save_before_finishing(self) -> None:
        """Everything this dataset finished is saved before it ends, however long the disk
        stays full; a kill ends the wait (the unsaved records are made again on resume)."""
        while not await self.engine.save(self, force_manifest=True):
            if self._stopping:
                if dropped := self.store.discard_unsaved():
                    self.engine.log(
                        "error", f"{self.config.name}: {dropped} finished records not saved; a resume makes them again", self.config.name
                    )
                self.storage_error, self._storage_failures = None, 0  # nothing left to save: a restart tries the disk afresh
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait(), max(0.05, self._storage_retry_at - self.engine.clock()))

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
            bad_lines=totals.bad_lines,
            truncated=totals.truncated,
            max_samples=self.config.max_samples,
            req_per_s=round(req_s, 3),
            tok_per_s=round(tok_s, 1),
            eta_s=round(eta, 1) if eta is not None else None,
            cost=round(totals.cost, 6),
            reasoning_tokens=totals.reasoning_tokens,
            reason=self.reason,
        )
