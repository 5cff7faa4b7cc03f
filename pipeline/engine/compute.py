"""The compute stages (prepare, extract, train, export, eval), scheduled: each in a worker thread,
one after another, except a train that follows its extract (``train.overlap_extract``): those two
run side by side. Torch is imported when a stage runs, never with the engine."""

from __future__ import annotations

import asyncio

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.cpus import apply_torch_threads
from eagleops.pipeline.protocol.events import Ack, Command, Pause, Resume, StageStatus
from eagleops.pipeline.protocol.host import StageHost
from eagleops.pipeline.stages import stage
from eagleops.pipeline.training.context import StageContext, StageKilled

__all__ = ["ComputeStages"]


class ComputeStages:
    def __init__(self, config: RunConfig, host: StageHost):
        self.config, self.host = config, host
        self.results: dict[str, object] = {}
        self._running: dict[str, StageContext] = {}  # two while a train follows its extract
        self._killed = False

    @property
    def running(self) -> list[str]:
        return list(self._running)

    def groups(self, stages: tuple[str, ...]) -> list[tuple[str, ...]]:
        """The compute stages in order, one at a time, except a train that follows its extract."""
        groups: list[tuple[str, ...]] = []
        for name in stages:
            if name == "train" and self.config.train.overlap_extract and groups and groups[-1] == ("extract",):
                groups[-1] = ("extract", "train")
            elif stage(name).compute:
                groups.append((name,))
        return groups

    async def run_together(self, names: tuple[str, ...]) -> bool:
        """Stages side by side; one that ends without finishing stops the others (a train
        following a failed extract would wait for shards forever), one that finishes tells them
        (an extract waiting for a finished train to free room stops). True if all finished."""
        if len(names) > 1:
            from eagleops.pipeline.training.stages import import_for_concurrent_stages

            await asyncio.to_thread(import_for_concurrent_stages)
            if self._killed:  # a kill during the import found no stage to stop
                return False
        # one thread team per stage running, each sized to the cores left to it: torch's default (every
        # core) spins threads at each barrier against whatever else holds a core (bench/cpu_threads.py)
        threads, why = await asyncio.to_thread(apply_torch_threads, 1 / len(names))
        self.host.log("info", f"{' and '.join(names)}: {threads} torch thread{'s' if threads > 1 else ''} ({why})")
        tasks = {asyncio.create_task(self._run_stage(name), name=f"stage {name}"): name for name in names}
        pending, all_done = set(tasks), True
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = any(task.result() != StageStatus.DONE for task in done)
            all_done = all_done and not failed
            for task in pending:
                if (ctx := self._running.get(tasks[task])) is None:
                    continue
                if failed:
                    ctx.kill()
                else:
                    ctx.partner_done.set()
        return all_done

    async def _run_stage(self, name: str) -> StageStatus:
        """A torch stage in a worker thread; its events cross back to the loop thread-safely."""
        from eagleops.pipeline.training.stages import stage_function

        loop = asyncio.get_running_loop()
        ctx = StageContext(name, lambda event: loop.call_soon_threadsafe(self.host.publish, event))
        self._running[name] = ctx
        if self._killed:
            ctx.kill()
        self.host.set_stage(name, StageStatus.RUNNING)
        try:
            result = await asyncio.to_thread(stage_function(name), self.config, ctx)
        except StageKilled:
            self.host.set_stage(name, StageStatus.KILLED, "killed; resumable")
            return StageStatus.KILLED
        except Exception as exc:
            self.host.fail_stage(name, exc)
            return StageStatus.FAILED
        else:
            self.results[name] = result
            self.host.set_stage(name, StageStatus.DONE)
            return StageStatus.DONE
        finally:
            self._running.pop(name, None)

    def command(self, command: Command) -> Ack:
        """Pause or resume a running stage (``command.stage``); a kill is the whole run's, and the
        engine's to make."""
        ctx = self._running.get(command.stage or "")
        if ctx is None:
            return Ack(False, f"stage {command.stage} is not running (running: {', '.join(self._running) or 'none'})")
        if isinstance(command, Pause):
            ctx.pause()
            self.host.set_stage(ctx.stage, StageStatus.PAUSED, "pauses at its next batch")
            return Ack(True, f"paused {ctx.stage} (at its next batch boundary)")
        if isinstance(command, Resume):
            ctx.resume()
            self.host.set_stage(ctx.stage, StageStatus.RUNNING)
            return Ack(True, f"resumed {ctx.stage}")
        return Ack(False, f"{command.kind} does not apply to a stage")

    def kill(self) -> None:
        self._killed = True
        for ctx in list(self._running.values()):
            ctx.kill()
