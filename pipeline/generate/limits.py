"""When a dataset stops: its token budget (one value, owned here), its sample cap, and the room
left for more requests while some are in flight."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.protocol.events import StopReason

__all__ = ["Budget", "Limits", "MIN_SAMPLES_FOR_MEAN"]

MIN_SAMPLES_FOR_MEAN = 8  # replies before their mean length predicts a request in flight


@dataclass
class Budget:
    """A dataset's token budget. The run file gives the first value; a live change replaces it
    and is kept in the dataset's manifest, so a restart keeps it (``live``)."""

    run_file: int
    live: int | None = None

    @property
    def tokens(self) -> int:
        return self.run_file if self.live is None else self.live


@dataclass
class Limits:
    """The budget and the sample cap, checked against what the dataset has accepted so far."""

    budget: Budget
    max_samples: int | None
    max_tokens: int  # a reply's ceiling: what a request in flight may add before replies are seen

    def expected_reply(self, tokens: int, samples: int) -> float:
        """Tokens a request in flight is expected to add: the mean so far, once it means something."""
        return tokens / samples if samples >= MIN_SAMPLES_FOR_MEAN else float(self.max_tokens)

    def room(self, tokens: int, samples: int, in_flight: int) -> bool:
        """Whether one more request may go out: what is in flight, at its expected length, still fits."""
        if tokens + in_flight * self.expected_reply(tokens, samples) >= self.budget.tokens:
            return False
        return self.max_samples is None or samples + in_flight < self.max_samples

    def reached(self, tokens: int, samples: int) -> StopReason | None:
        if tokens >= self.budget.tokens:
            return StopReason.BUDGET
        if self.max_samples is not None and samples >= self.max_samples:
            return StopReason.SAMPLE_CAP
        return None
