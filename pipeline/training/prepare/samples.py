"""Training samples, each the sequence the target processed when it wrote a reply.

For every reply the target wrote (``target_turns``), the sample is the template's rendering of
the conversation before it, as the server saw it (the target's earlier replies without their
thinking, which no server sends back), with the generation prompt in the words of the dataset's
thinking mode; then the reply **exactly as the target emitted it**: the server's token ids
where it gave them, else rebuilt in the target's own format (``ReplyFormat``, learned from the
template). The loss covers what the target emitted, its turn end included; under
``thinking = "drop"`` (and under ``off``, for thinking that came anyway: gpt-oss cannot stop)
the thinking stays in the sequence (the target wrote the answer after it) but carries no loss. A reply whose sequence continues into the next reply's prompt shares one
sample with it; where the template renders history differently (Qwen3 drops earlier thinking),
each reply is a sample of its own, as the target saw it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from eagleops.pipeline.formats.thinking import split_thinking
from eagleops.pipeline.training.modeling.reply_format import ReplyFormat, Unrepresentable, learn_reply_format
from eagleops.pipeline.training.prepare.chat_template import PrepareError, render_ids, render_text

__all__ = ["Built", "Reply", "SampleBuilder", "Unrepresentable"]


@dataclass(frozen=True)
class Reply:
    """One reply the target wrote, as trained: where it sits in its sample and what it is."""

    start: int  # first id of the reply in the sample
    thinking: int  # ids of its thinking (opens + thought + closes); 0 without (a bare prefix is trained)
    length: int  # ids of the whole reply, turn end included
    answer: str
    thought: str | None
    exact: bool  # the server's own ids


@dataclass
class Built:
    """One sample: ids, loss mask, length before truncation, the replies in it."""

    ids: list[int]
    mask: list[int]
    replies: list[Reply] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.ids)


def _find(ids: list[int], part: list[int], start: int = 0) -> int:
    """Index just past the first occurrence of ``part`` in ``ids`` from ``start``; -1 if none."""
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return i + len(part)
    return -1


def _target_turns(messages: list[dict[str, Any]], trained: Collection[int] | None) -> list[int]:
    """The indices of the replies the target wrote (None: every assistant turn but tool calls)."""
    return [
        k for k, m in enumerate(messages) if m["role"] == "assistant" and (k in trained if trained is not None else not m.get("tool_calls"))
    ]


def _as_sent(messages: list[dict[str, Any]], turns: Collection[int]) -> list[dict[str, Any]]:
    """The conversation as the server was sent it: the target's replies without their thinking
    (their tool calls kept: the next turn answers them)."""
    return [_without_thinking(m) if k in turns else m for k, m in enumerate(messages)]


def _without_thinking(message: dict[str, Any]) -> dict[str, Any]:
    sent = {"role": message["role"], "content": message.get("content") or ""}
    return {**sent, "tool_calls": message["tool_calls"]} if message.get("tool_calls") else sent


class SampleBuilder:
    """Samples of one target; ``formats`` and ``kwargs``: per thinking mode, the reply format and
    the ``chat_template_kwargs`` generate sent."""

    def __init__(
        self,
        tokenizer: Any,
        formats: dict[str, ReplyFormat],
        kwargs: dict[str, dict[str, Any]],
        stop_ids: Collection[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.formats = formats
        self.kwargs = kwargs
        self.stop_ids = frozenset(stop_ids)
        self.exact_mismatches = 0
        self.prompt_mismatches = 0  # server prompts our rendering of the record does not give
        self.served_prompts = 0  # prompts trained on as the server fed them

    @classmethod
    def learn(cls, tokenizer: Any, kwargs: dict[str, dict[str, Any]], stop_ids: Collection[int]) -> SampleBuilder:
        """A builder whose reply formats are learned from the tokenizer's template, per mode."""
        return cls(tokenizer, {mode: learn_reply_format(tokenizer, given) for mode, given in kwargs.items()}, kwargs, stop_ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _thinking_end(self, fmt: ReplyFormat, ids: list[int], thought: str | None, *, calls: bool = False) -> int | None:
        """Where the thinking ends in the server's ids: past the close and the whitespace the
        format writes after it; None where it cannot be found. A reply without thinking has
        none (its bare prefix, Qwen3's empty block, is written by the target and trained). A
        reply that calls tools may close its thinking on the way to another channel than the
        answer's (gpt-oss: ``<|end|>`` then commentary, not final): the longest start of the
        close that is there ends it."""
        if not thought:
            return 0
        if not fmt.shows_thinking or not (fmt.closes or "").strip():
            return None
        closes = self._encode((fmt.closes or "").strip())
        end = _find(ids, closes)
        for n in range(len(closes) - 1, 0, -1) if end < 0 and calls else ():
            if (end := _find(ids, closes[:n])) >= 0:
                break
        if end < 0:
            return None
        while end < len(ids) and ids[end] not in self.stop_ids and not self.tokenizer.decode([ids[end]]).strip():
            end += 1
        return end

    def _rebuilt(self, fmt: ReplyFormat, thought: str | None, answer: str, finished: bool) -> tuple[list[int], list[int]]:
        """(thinking ids, answer ids) of the reply rebuilt in the target's format."""
        thinking_text, answer_text = fmt.pieces(thought, answer, finished=finished)
        return self._encode(thinking_text), self._encode(answer_text)

    def reply_ids(
        self,
        fmt: ReplyFormat,
        thought: str | None,
        answer: str,
        exact: list[int] | None,
        finished: bool,
        *,
        split: bool,
        calls: bool = False,
    ) -> tuple[list[int], int, bool]:
        """(the reply's ids, how many of them are thinking, whether they are the server's).
        ``split``: the thinking must be told apart (it is not trained); with the server's ids
        and no need to split, no format is needed at all."""
        end = [fmt.end_id] if finished and fmt.end_id is not None else []
        if exact:
            ids = list(exact)
            if finished and ids[-1] not in self.stop_ids:
                ids += end  # a server that leaves the stop token out
            try:
                thinking, answer_ids = self._rebuilt(fmt, thought, answer, finished)
                self.exact_mismatches += ids[: len(thinking) + len(answer_ids)] != thinking + answer_ids
            except Unrepresentable:
                self.exact_mismatches += 1
            boundary = self._thinking_end(fmt, ids, thought, calls=calls)
            if boundary is not None or not split:
                return ids, boundary or 0, True
            if calls:  # rebuilt from its text, a reply that calls tools would lose its calls
                raise Unrepresentable("the end of its thinking cannot be found in the server's ids of a reply that calls tools")
        thinking, answer_ids = self._rebuilt(fmt, thought, answer, finished)
        return thinking + answer_ids + end, len(thinking) if thought else 0, False

    def served_prompt(
        self, messages: list[dict[str, Any]], trained: Collection[int] | None, thinking: str, *, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids a server fed the target to write the conversation's last reply: what eval
        replays on held-out conversations."""
        sent = _as_sent(messages, _target_turns(messages, trained))
        return render_ids(self.tokenizer, sent[:-1], generation_prompt=True, **self._kwargs(thinking, tools))

    def _kwargs(self, thinking: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The template's kwargs as the server passed them: the thinking switch, and the row's tools."""
        return {**self.kwargs[thinking], "tools": tools} if tools else self.kwargs[thinking]

    def _served(self, rendered: list[int], served: list[int] | None) -> list[int]:
        """The prompt to train on: the server's ids where it gave them, else our rendering."""
        if not served:
            return rendered
        self.served_prompts += 1
        self.prompt_mismatches += list(served) != rendered
        return list(served)

    def _rendered_call(
        self,
        fmt: ReplyFormat,
        history: list[dict[str, Any]],
        reply: dict[str, Any],
        prompt: list[int],
        kwargs: dict[str, Any],
        thought: str | None,
        split: bool,
    ) -> tuple[list[int], int, bool]:
        """A reply that calls tools, without the server's ids: the tokens the target's template
        gives it after the prompt (the calls in the template's own syntax), up to its turn end;
        (ids, how many are thinking, False: not the server's)."""
        # the text after the prompt's, tokenized on its own as the target emitted it after the
        # prompt (tokenizing the whole could merge a token across the boundary: `<think>\n` + `\n`)
        full = render_text(self.tokenizer, [*history, reply], **kwargs)
        opening = render_text(self.tokenizer, history, generation_prompt=True, **kwargs)
        ids = self._encode(full[len(opening) :]) if full.startswith(opening) else []
        ends = [i for i, token in enumerate(ids) if token in self.stop_ids]
        ids = ids[: ends[0] + 1] if ends else ids
        boundary = self._thinking_end(fmt, ids, thought)  # rebuilt, a call's channel may not be the model's: no fallback
        if not full.startswith(opening) or (split and boundary is None):
            raise PrepareError(
                f"turn {len(history)} calls tools and the template cannot show it after its prompt as the target wrote it; "
                "generate from a server that returns token ids (vLLM)"
            )
        return ids, boundary or 0, False

    def build(
        self,
        messages: list[dict[str, Any]],
        trained: Collection[int] | None,
        thinking: str,
        *,
        exact: list[int] | None = None,
        exact_turns: dict[int, list[int]] | None = None,
        finished: bool = True,
        on_reply: Callable[[int], None] = lambda k: None,
        tools: list[dict[str, Any]] | None = None,
        served_prompts: dict[int, list[int]] | None = None,
    ) -> list[Built]:
        """The samples of one conversation; ``trained``: the indices of the replies the target
        wrote (None: every assistant turn); ``exact``: the last reply's ids from the server,
        ``exact_turns``: any reply's, by index (a regenerated conversation's);
        ``finished``: whether that reply ended (not cut at ``max_tokens``); ``served_prompts``:
        the ids the server fed the target before a reply, by index, where it returned them:
        the truth, trained on as they are (our rendering is checked against them and counted)."""
        fmt, kwargs = self.formats[thinking], self._kwargs(thinking, tools)
        turns = _target_turns(messages, trained)
        sent = _as_sent(messages, turns)
        samples: list[Built] = []
        current: Built | None = None
        for k in turns:
            on_reply(k)
            answer, thought = split_thinking(messages[k].get("content") or "", messages[k].get("reasoning_content"))
            untrained_thinking = thinking != "keep"  # off: thinking that came anyway (gpt-oss always thinks)
            if untrained_thinking and not fmt.shows_thinking:
                thought = None  # not trained, and this template has no place for it: left out
            last = k == len(messages) - 1
            rendered = render_ids(self.tokenizer, sent[:k], generation_prompt=True, **kwargs)
            prompt = self._served(rendered, (served_prompts or {}).get(k))
            exact_ids = exact if last and exact else (exact_turns or {}).get(k)
            try:
                if messages[k].get("tool_calls") and not exact_ids:
                    ids, thinking_ids, is_exact = self._rendered_call(
                        fmt, sent[:k], messages[k], rendered, kwargs, thought, untrained_thinking
                    )
                else:
                    ids, thinking_ids, is_exact = self.reply_ids(
                        fmt,
                        thought,
                        answer,
                        exact_ids,
                        finished or not last,
                        split=untrained_thinking,
                        calls=bool(messages[k].get("tool_calls")),
                    )
            except Unrepresentable as exc:
                raise PrepareError(
                    f"turn {k}: {exc}, so the target's thinking cannot be trained as it wrote it; "
                    'set thinking = "drop" for this dataset, or generate from a server that returns token ids (vLLM)'
                ) from None
            loss_from = thinking_ids if untrained_thinking else 0
            mask = [0] * loss_from + [1] * (len(ids) - loss_from)
            if current is not None and prompt[: current.length] == current.ids:
                current.mask += [0] * (len(prompt) - current.length)
                current.ids = list(prompt)
            else:
                if current is not None:
                    samples.append(current)
                current = Built(list(prompt), [0] * len(prompt))
            current.replies.append(Reply(current.length, thinking_ids, len(ids), answer, thought, is_exact))
            current.ids += ids
            current.mask += mask
        if current is not None:
            samples.append(current)
        return samples
