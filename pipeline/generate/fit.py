"""What a request may cost so that every token paid for is trained: the prompt as the target's
template renders it must leave room for a reply under prepare's ``max_length``, and the request
never asks for more completion tokens than that room (prepare would cut them off).

A prompt that leaves less than ``min_reply`` tokens is skipped before anything is sent, or
shortened by dropping its earliest turns (``long_prompts = "drop-oldest"``), so that the target
answers exactly the conversation that is trained. The tokens are counted by ``count``, which the
engine builds from the target's own tokenizer and template (generate loads no model code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Fitted", "PromptCounter", "PromptFit", "Skipped", "TooLong"]

Messages = tuple[dict[str, Any], ...]
# (messages as sent, tool schemas, thinking mode) -> the prompt's tokens, generation prompt
# included; blocking (a tokenizer): called from a worker thread
PromptCounter = Callable[[Messages, "tuple[dict[str, Any], ...] | None", str], int]


@dataclass(frozen=True)
class Fitted:
    messages: Messages  # what to send: the prompt, or its later turns
    max_tokens: int  # what the reply may take: the request's ceiling within the sample's room
    prompt_tokens: int
    dropped: int = 0  # earliest messages left out


@dataclass(frozen=True)
class TooLong:
    reason: str


class Skipped(Exception):
    """A row not sent (or a conversation whose first reply was not): nothing was paid for it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PromptFit:
    count: PromptCounter
    max_length: int  # prepare's: the sample, prompt and reply, is cut there
    min_reply: int
    max_tokens: int  # [sampling] max_tokens

    def fit(self, messages: Messages, tools: Messages | None, thinking: str, *, shorten: bool) -> Fitted | TooLong:
        """Blocking: counts with the tokenizer."""
        dropped = 0
        while True:
            tokens = self.count(messages, tools, thinking)
            room = self.max_length - tokens
            if room >= self.min_reply:
                return Fitted(messages, min(self.max_tokens, room), tokens, dropped)
            shorter = _without_oldest_exchange(messages) if shorten else None
            if shorter is None:
                break
            dropped += len(messages) - len(shorter)
            messages = shorter
        what = f"its last {len(messages)} messages take" if dropped else "it takes"
        return TooLong(
            f"prompt too long to train: {what} {tokens} tokens of prepare.max_length {self.max_length}, "
            f"leaving {max(room, 0)} for the reply (sampling.min_reply_tokens {self.min_reply})"
        )


def _without_oldest_exchange(messages: Messages) -> Messages | None:
    """The conversation without its first exchange (a user turn and everything up to the next
    one: replies, tool calls and their results stay together); system messages stay. None when
    only the last user turn is left."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    starts = [i for i, m in enumerate(rest) if m.get("role") == "user" and i > 0]
    return tuple(system + rest[starts[0] :]) if starts else None
