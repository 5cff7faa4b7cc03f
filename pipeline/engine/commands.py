"""Commands into the engine: pause, resume, kill, budget; for datasets and compute stages."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from pipeline.config import ALL_STAGES, format_tokens
from pipeline.engine.detail import dataset_detail, failure_reasons
from pipeline.protocol.events import Ack, Command, DatasetState, Kill, Pause, Resume, SetBudget, StageStatus

if TYPE_CHECKING:
    from pipeline.engine.datasets import DatasetRunner
    from pipeline.engine.engine import Engine

__all__ = ["EngineCommands"]


class EngineCommands:
    """The command half of ``Engine`` (a mixin: it acts on the engine's own state)."""

    async def execute(self: Engine, command: Command) -> Ack:
        if command.dataset in ALL_STAGES and command.dataset not in self.runners:
            ack = self._stage_command(command)
            self.log("info" if ack.ok else "warning", f"command {command.kind} {command.dataset}: {ack.message}")
            return ack
        if command.dataset is None and isinstance(command, (Pause, Resume)):
            for stage in list(self._stage_ctxs):
                self._stage_command(type(command)(stage))
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

    def _stage_command(self: Engine, command: Command) -> Ack:
        ctx = self._stage_ctxs.get(command.dataset or "")
        if ctx is None:
            running = ", ".join(self._stage_ctxs) or "none"
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

    def _targets(self: Engine, name: str | None) -> list[DatasetRunner] | None:
        if name is None:
            return list(self.runners.values())
        runner = self.runners.get(name)
        return [runner] if runner else None

    async def detail(self: Engine, name: str) -> dict:
        """One dataset in detail (failures by reason from its failed.jsonl, latency, endpoints)."""
        runner = self.runners.get(name)
        if runner is None:
            return {"ok": False, "message": f"no dataset named {name!r} (have: {', '.join(self.runners)})"}
        detail = dataset_detail(runner)
        detail["failures"], detail["failures_partial"] = await asyncio.to_thread(failure_reasons, runner.store.failed_path)
        return {"ok": True, "detail": detail}

    async def _set_budget(self: Engine, runner: DatasetRunner, tokens: int) -> Ack:
        old = runner.budget
        runner.budget = tokens
        runner.store.budget_override = tokens
        saved = await self.save(runner, force_manifest=True)
        runner.wake()
        note = "" if saved else f" (not saved yet: {runner.storage_error})"
        if tokens > old and runner.state == DatasetState.DONE and not runner.at_limit() and not self._killed:
            if runner.reason.startswith("budget"):
                runner.reason = ""
                self._start(runner)
                note += "; dataset resumed"
        elif tokens < old and runner.in_flight:
            if self.config.cancel_in_flight_over_budget and runner.store.accepted.tokens >= tokens:
                runner.cancel_requests()
                note += f"; cancelled {runner.in_flight} in flight"
            else:
                note += f"; no new requests, {runner.in_flight} in flight finish"
        self.publish(runner.progress())
        return Ack(True, f"budget {runner.config.name}: {format_tokens(old)} -> {format_tokens(tokens)}{note}")

    async def _kill_runner(self, runner: DatasetRunner) -> None:
        task = runner.task
        if task is not None and not task.done():
            runner.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def kill(self: Engine) -> None:
        """Stop everything now (Ctrl-C): cancel in-flight requests, keep finished work."""
        if self._killed:
            return
        self._killed = True
        for ctx in list(self._stage_ctxs.values()):
            ctx.kill()
        for runner in self.runners.values():
            runner.stop()
        if self._served is not None:  # a vLLM still loading would hold the kill for minutes
            threading.Thread(target=self._served.stop, name="stop-vllm", daemon=True).start()
        self._changed.set()
