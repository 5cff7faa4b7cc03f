"""The engine's events out: every subscriber (the console, ``--no-tui``, an attached socket) gets
the current snapshot, then each event as it happens, through a bounded queue of its own."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from eagleops.pipeline.protocol.events import Event, LogEvent, StageMetrics, StageProgress

__all__ = ["EventBus", "Subscription"]

LOG_TAIL = 200  # log lines an attaching console receives first
METRICS_TAIL = 300  # stage measurements it receives too: train's loss curve so far, not from the attach on


class EventBus:
    def __init__(self, snapshot: Callable[[], list[Event]]):
        self._snapshot = snapshot
        self.subscribers: set[Subscription] = set()
        self.log_tail: list[LogEvent] = []
        self.metrics_tail: deque[StageMetrics] = deque(maxlen=METRICS_TAIL)
        # each stage's last progress: an attaching console shows steps, bar and ETA at once, not
        # at the next step (minutes apart when a step is slow)
        self.progress_latest: dict[str, StageProgress] = {}

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        for event in self._snapshot():
            sub.put(event)
        self.subscribers.add(sub)
        return sub

    def publish(self, event: Event) -> None:
        if isinstance(event, LogEvent):
            self.log_tail = (self.log_tail + [event])[-LOG_TAIL:]
        elif isinstance(event, StageMetrics):
            self.metrics_tail.append(event)
        elif isinstance(event, StageProgress):
            self.progress_latest[event.stage] = event
        for sub in list(self.subscribers):
            sub.put(event)

    def close(self) -> None:
        """End every subscription: their iterators stop after what is queued."""
        for sub in list(self.subscribers):
            sub.put(None)


class Subscription:
    """A bounded queue of events; a slow reader loses the oldest, never blocks the engine."""

    def __init__(self, bus: EventBus, maxsize: int = 2000):
        self._bus = bus
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize)

    def put(self, event: Event | None) -> None:
        while True:
            try:
                self.queue.put_nowait(event)
                return
            except asyncio.QueueFull:
                self.queue.get_nowait()

    def close(self) -> None:
        self._bus.subscribers.discard(self)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        try:
            while (event := await self.queue.get()) is not None:
                yield event
        finally:
            self.close()
