"""How the target writes a reply after its generation prompt, learned from its own chat template.

A reply is trained as the target emitted it: ``opens + thinking + closes + answer + turn end``
(or ``bare + answer + turn end`` when it did not think). Those pieces differ per model:

| target | generation prompt ends | opens | closes | bare |
|---|---|---|---|---|
| Qwen3 | ``assistant\\n`` | ``<think>\\n`` | ``\\n</think>\\n\\n`` | ``<think>\\n\\n</think>\\n\\n`` |
| Kimi-K2.5 | ``<think>`` | | ``</think>`` | ``</think>`` |
| Kimi-K2-Thinking | ``<|im_middle|>`` | ``<think>`` | ``</think>`` | ``<think></think>`` |
| DeepSeek-V3.1 (thinking) | ``<think>`` | | ``</think>`` | ``</think>`` |
| gpt-oss | ``<|start|>assistant`` | ``<|channel|>analysis<|message|>`` | ``<|end|><|start|>assistant<|channel|>final<|message|>`` | ``<|channel|>final<|message|>`` |

That table is what the tests check; the code never reads a model name. It renders probe
conversations (a marked thought and a marked answer) and reads the pieces off the template:

1. a last assistant turn whose thinking the template renders (under ``reasoning_content``,
   ``reasoning`` or ``thinking``), plain or calling a tool (Kimi's templates show thinking only
   in turns after the last plain answer): the text between the generation prompt, the thought
   and the answer;
2. else a template that renders no thinking but cuts it off the content at ``</think>``
   (DeepSeek-V3.1): the target closes its thinking with that tag, and opens it unless the
   generation prompt already did.

Anything else shows no thinking: a reply with thinking cannot be rebuilt for it (only the
server's own token ids can say what the target wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagleops.pipeline.formats.thinking import THINK_CLOSE, THINK_OPEN
from eagleops.pipeline.training.modeling.turns import turn_ends

__all__ = ["PROBE_QUESTION", "REASONING_FIELDS", "ReplyFormat", "Unrepresentable", "learn_reply_format"]

# the keys templates read an assistant turn's thinking from
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")

PROBE_QUESTION = "eagleopsprobequestion"  # the user turn of every probe, where a generation prompt's tail starts
_USER = {"role": "user", "content": PROBE_QUESTION}
_THOUGHT = "eagleopsprobethought"
_ANSWER = "eagleopsprobeanswer"
_CALL = {"id": "call_0", "type": "function", "function": {"name": "eagleopsprobetool", "arguments": "{}"}}


class Unrepresentable(ValueError):
    """A reply this target's format cannot hold as written (thinking where the template shows none)."""


@dataclass(frozen=True)
class ReplyFormat:
    generation_prompt: str  # what the template appends to ask for a reply, for a one-turn chat
    opens: str | None  # before the thinking; None: the template shows no thinking
    closes: str | None  # between the thinking and the answer
    bare: str  # before the answer of a reply without thinking
    end_id: int | None  # the token that ends the reply
    learned_from: str  # how, in words, for `eagleops inspect`

    @property
    def shows_thinking(self) -> bool:
        return self.opens is not None

    def pieces(self, thinking: str | None, answer: str, *, finished: bool = True) -> tuple[str, str]:
        """(the thinking part, the answer part) of the reply's text as the target wrote it; a
        reply cut while thinking (``finished`` False, no answer) has no close."""
        if not thinking:
            return self.bare, answer
        if self.opens is None or self.closes is None:
            raise Unrepresentable("the chat template shows no thinking")
        if not finished and not answer:
            return self.opens + thinking, ""
        return self.opens + thinking + self.closes, answer


def _text(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], *, prompt: bool = False) -> str | None:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **kwargs))
    except Exception:  # a template may refuse a probe (gpt-oss: thinking plus content with a call)
        return None


def _after_prompt(tokenizer: Any, reply: dict[str, Any], kwargs: dict[str, Any], prompt: str) -> str | None:
    """What the template writes after the generation prompt when ``reply`` is the last turn;
    None where that rendering does not continue the prompt."""
    text = _text(tokenizer, [_USER, reply], kwargs)
    return text[len(prompt) :] if text is not None and text.startswith(prompt) else None


def learn_reply_format(tokenizer: Any, kwargs: dict[str, Any] | None = None) -> ReplyFormat:
    """The target's reply format under these ``chat_template_kwargs`` (the thinking mode's)."""
    kwargs = dict(kwargs or {})
    prompt = _text(tokenizer, [_USER], kwargs, prompt=True) or ""
    ends = turn_ends(tokenizer)
    end_id = ends[0] if ends else None
    plain = _after_prompt(tokenizer, {"role": "assistant", "content": _ANSWER}, kwargs, prompt)
    bare = plain[: plain.index(_ANSWER)] if plain is not None and _ANSWER in plain else None
    for field in REASONING_FIELDS:
        for extra in ({}, {"tool_calls": [_CALL]}):
            reply = {"role": "assistant", "content": _ANSWER, field: _THOUGHT, **extra}
            tail = _after_prompt(tokenizer, reply, kwargs, prompt)
            if tail is None or _THOUGHT not in tail or _ANSWER not in tail[tail.index(_THOUGHT) :]:
                continue
            opens, rest = tail.split(_THOUGHT, 1)
            closes = rest[: rest.index(_ANSWER)]
            how = f"the template renders `{field}`" + (" in a turn that calls a tool" if extra else "")
            return ReplyFormat(prompt, opens, closes, opens + closes if bare is None else bare, end_id, how)
    cut = _text(tokenizer, [_USER, {"role": "assistant", "content": _THOUGHT + THINK_CLOSE + _ANSWER}], kwargs)
    if cut is not None and _ANSWER in cut and _THOUGHT not in cut:
        opens = "" if prompt.rstrip().endswith(THINK_OPEN) else THINK_OPEN
        how = f"the template cuts thinking off at {THINK_CLOSE}" + (f" after a prompt ending {THINK_OPEN}" if not opens else "")
        return ReplyFormat(prompt, opens, THINK_CLOSE, opens + THINK_CLOSE if bare is None else bare, end_id, how)
    return ReplyFormat(prompt, None, None, bare or "", end_id, "the template shows no thinking")
