"""The compute stages in the engine: each in a worker thread, one after another, except a
train that follows its extract (``train.overlap_extract``): those two run side by side."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pipeline.protocol.events import StageState, StageStatus
from pipeline.training.context import StageContext, StageKilled

if TYPE_CHECKING:
    from pipeline.engine.engine import Engine

__all__ = ["EngineStages"]


class EngineStages:
    """The stage half of ``Engine`` (a mixin, as ``EngineCommands`` is)."""

    def _stage_failed(self: Engine) -> bool:
        return any(state.status == StageStatus.FAILED for state in self.stage_states.values())

    def _set_stage(self: Engine, name: str, status: StageStatus, detail: str = "") -> None:
        self.stage_states[name] = StageState(name, status, detail)
        self.publish(self.stage_states[name])

    def _compute_groups(self: Engine) -> list[tuple[str, ...]]:
        """The compute stages in order, one at a time, except a train that follows its extract."""
        groups: list[tuple[str, ...]] = []
        for name in self.stages:
            if name == "train" and self.config.train.overlap_extract and groups and groups[-1] == ("extract",):
                groups[-1] = ("extract", "train")
            elif name != "generate":
                groups.append((name,))
        return groups

    async def _compute_together(self: Engine, names: tuple[str, ...]) -> None:
        """Stages side by side; one that ends without finishing stops the others (a train
        following a failed extract would wait for shards forever), one that finishes tells them
        (an extract waiting for a finished train to free room stops)."""
        if len(names) > 1:
            from pipeline.training.stages import import_for_concurrent_stages

            await asyncio.to_thread(import_for_concurrent_stages)
            if self._killed:  # a kill during the import found no stage to stop
                return
        tasks = {asyncio.create_task(self._compute_stage(name), name=f"stage {name}"): name for name in names}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = any(self.stage_states[tasks[task]].status != StageStatus.DONE for task in done)
            for task in pending:
                if (ctx := self._stage_ctxs.get(tasks[task])) is None:
                    continue
                if failed:
                    ctx.kill()
                else:
                    ctx.partner_done.set()

    async def _compute_stage(self: Engine, name: str) -> None:
        """A torch stage in a worker thread; its events cross back to the loop thread-safely."""
        from pipeline.training.stages import stage_functions

        loop = asyncio.get_running_loop()
        ctx = StageContext(name, lambda event: loop.call_soon_threadsafe(self.publish, event))
        self._stage_ctxs[name] = ctx
        if self._killed:
            ctx.kill()
        self._set_stage(name, StageStatus.RUNNING)
        try:
            result = await asyncio.to_thread(stage_functions()[name], self.config, ctx)
        except StageKilled:
            self._set_stage(name, StageStatus.KILLED, "killed; resumable")
        except Exception as exc:
            self.log("error", self.redact(f"{name}: {type(exc).__name__}: {exc}"))
            self._set_stage(name, StageStatus.FAILED, self.redact(str(exc))[:200])
        else:
            self.stage_results[name] = result
            self._set_stage(name, StageStatus.DONE)
        finally:
            self._stage_ctxs.pop(name, None)
