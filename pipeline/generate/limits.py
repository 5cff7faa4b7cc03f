"""When a dataset stops: its token budget (one value, owned here), its sample cap, and the room
left for more requests while some are in flight. ``Admission`` is the whole decision, a pure
object: what the dataset has accepted goes in, "may one more go out?" comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagleops.pipeline.protocol.events import StopReason

__all__ = ["MIN_SAMPLES_FOR_MEAN", "Admission", "Budget", "Conversation", "InFlight", "Limits"]

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

    def expected_reply(self, tokens: int, replies: int) -> float:
        """Tokens a reply still to come is expected to add: the mean so far, once it means something."""
        return tokens / replies if replies >= MIN_SAMPLES_FOR_MEAN else float(self.max_tokens)

    def room(self, tokens: int, samples: int, in_flight: int, reserved: float) -> bool:
        """Whether one more request may go out: ``tokens`` written (or written by conversations
        still in flight) and ``reserved``, what the replies still to come are expected to add, fit."""
        if tokens + reserved >= self.budget.tokens:
            return False
        return self.max_samples is None or samples + in_flight < self.max_samples

    def reached(self, tokens: int, samples: int) -> StopReason | None:
        if tokens >= self.budget.tokens:
            return StopReason.BUDGET
        if self.max_samples is not None and samples >= self.max_samples:
            return StopReason.SAMPLE_CAP
        return None


@dataclass
class Conversation:
    """One request in flight: the replies it will ask for and those it has, with their tokens."""

    replies: int
    replied: int = 0
    tokens: int = 0


@dataclass
class InFlight:
    """What a dataset's requests in flight hold: replies still to ask for and tokens of replies
    in but not yet recorded. Under ``regenerate = "all"`` a conversation asks for several."""

    replies_left: int = 0
    unrecorded: int = 0
    replies: int = 0  # this session's, for their mean length
    reply_tokens: int = 0

    def begin(self, replies: int) -> Conversation:
        self.replies_left += replies
        return Conversation(replies)

    def replied(self, conversation: Conversation, tokens: int) -> None:
        conversation.replied, conversation.tokens = conversation.replied + 1, conversation.tokens + tokens
        self.replies, self.reply_tokens = self.replies + 1, self.reply_tokens + tokens
        self.replies_left, self.unrecorded = self.replies_left - 1, self.unrecorded + tokens

    def end(self, conversation: Conversation) -> None:
        """Recorded, failed or cancelled: it holds nothing any more."""
        self.replies_left -= conversation.replies - conversation.replied
        self.unrecorded -= conversation.tokens


@dataclass
class Admission:
    """Whether a dataset may send one more request: its limits, the requests it has in flight
    and what their replies are expected to add (a reservation per reply still to come: the mean
    reply so far, or ``max_tokens`` before that means anything). No clock, no I/O: the runner
    tells it what was accepted, and each request's begin, replies and end."""

    limits: Limits
    regenerate_all: bool  # a request is a conversation of several replies
    flight: InFlight = field(default_factory=InFlight)
    in_flight: int = 0  # requests

    @property
    def budget(self) -> int:
        return self.limits.budget.tokens

    def room(self, tokens: int, samples: int) -> bool:
        """One more request fits beside ``tokens`` and ``samples`` accepted and what is in flight."""
        flight = self.flight
        if self.regenerate_all:  # a record's mean is a conversation's: estimate per reply
            reserved = flight.replies_left * self.limits.expected_reply(flight.reply_tokens, flight.replies)
        else:
            reserved = self.in_flight * self.limits.expected_reply(tokens, samples)
        return self.limits.room(tokens + flight.unrecorded, samples, self.in_flight, reserved)

    def may_go_on(self, tokens: int) -> bool:
        """A conversation in flight asks for its next reply only while the budget has room."""
        return tokens + self.flight.unrecorded < self.budget

    def reached(self, tokens: int, samples: int) -> StopReason | None:
        return self.limits.reached(tokens, samples)

    def begin(self, replies: int) -> Conversation:
        """A request goes out, asking for ``replies`` replies."""
        self.in_flight += 1
        return self.flight.begin(replies)

    def end(self, conversation: Conversation) -> None:
        """Recorded, failed or cancelled."""
        self.flight.end(conversation)
        self.in_flight -= 1
