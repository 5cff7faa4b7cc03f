"""What a stage needs of the engine that hosts it: a way to be heard. Stages reach the engine
only through this, so none imports it (the engine imports them)."""

from __future__ import annotations

from typing import Protocol

from eagleops.pipeline.protocol.events import Event, StageStatus

__all__ = ["StageHost"]


class StageHost(Protocol):
    def publish(self, event: Event) -> None:
        """Hand an event to every subscriber (the console, --no-tui, the socket), its words
        redacted by the host. Loop thread only."""

    def log(self, level: str, message: str, dataset: str | None = None) -> None:
        """A log line, redacted by the host before anyone sees it."""

    def set_stage(self, name: str, status: StageStatus, detail: str = "") -> None:
        """The stage's state in the run's stage table."""

    def fail_stage(self, name: str, exc: BaseException) -> None:
        """A stage that raised: logged and FAILED, as every stage fails."""
