"""Conversations rendered by the target's own chat template, with the assistant turns marked in
the loss mask. Spans come from the template itself: the tokens that rendering turn k adds after
the generation prompt of turns < k are that reply (its end-of-turn token included), so training
sees exactly what serving will, for any template that renders prefixes consistently."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pipeline.config import TargetConfig
from pipeline.errors import InputError
from pipeline.training.modeling.target import load_target_tokenizer
from pipeline.training.modeling.turns import turn_ends

__all__ = ["PrepareError", "exact_mismatch", "load_chat_tokenizer", "tokenize_conversation", "tokenize_samples", "with_exact_reply"]


class PrepareError(InputError):
    """Generated records, a pre-tokenized set or a chat template that prepare cannot use."""


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)) if messages else []


def _inline(message: dict[str, Any]) -> dict[str, Any]:
    turn = {key: value for key, value in message.items() if key != "reasoning_content"}
    turn["content"] = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    return turn


def _with_renderable_reasoning(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each turn's thinking where the template renders it: its
    ``reasoning_content`` field (Qwen3, Kimi-K2 style), else ``<think>`` inline in the content (the
    form templates that keep it in content expect). A template that shows neither is refused: the
    drafter would never see what the target spends most of its decoding on."""
    out = list(messages)
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("reasoning_content"):
            continue
        plain = {key: value for key, value in message.items() if key != "reasoning_content"}
        shown = _render(tokenizer, [*out[:k], message])
        if shown != _render(tokenizer, [*out[:k], plain]):
            continue
        inline = _inline(message)
        if message["reasoning_content"] in tokenizer.decode(_render(tokenizer, [*out[:k], inline])):
            out[k] = inline
            continue
        raise PrepareError(
            f"the chat template renders no thinking (turn {k}: neither `reasoning_content` nor <think> in the content); "
            'use the target\'s own template, or thinking = "drop" for this dataset'
        )
    return out


def tokenize_samples(
    tokenizer: Any, messages: list[dict[str, Any]], max_length: int, trained: Collection[int] | None = None
) -> list[tuple[list[int], list[int], int]]:
    """[(input_ids, loss_mask, untruncated length)] of one conversation rendered by the tokenizer's
    chat template; the loss mask covers each assistant turn the target wrote (``trained``: their
    indices; None: every assistant turn), thinking and answer.

    Spans come from the template itself: the tokens that rendering turn k adds after the
    generation prompt of the turns before it. Templates that drop earlier turns' thinking from
    the history (Qwen3's do) render such a turn differently once the conversation goes on: that
    turn is then a sample of its own, rendered as the target saw it when it wrote it."""
    messages = _with_renderable_reasoning(tokenizer, messages)
    full = _render(tokenizer, messages)
    mask = [0] * len(full)
    separate: list[tuple[list[int], list[int], int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or (trained is not None and k not in trained):
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True)
        # the last turn's render is the whole conversation: no need to render it twice
        through = full if k + 1 == len(messages) else _render(tokenizer, messages[: k + 1])
        if through[: len(before)] != before:
            raise PrepareError(
                f"the chat template does not render conversations prefix-consistently, so assistant spans cannot be located (turn {k})"
            )
        if full[: len(through)] == through:
            mask[len(before) : len(through)] = [1] * (len(through) - len(before))
        elif message.get("reasoning_content"):
            own = [0] * len(before) + [1] * (len(through) - len(before))
            separate.append((through[:max_length], own[:max_length], len(through)))
        else:
            raise PrepareError(
                f"the chat template does not render conversations prefix-consistently, so assistant spans cannot be located (turn {k})"
            )
    return [(full[:max_length], mask[:max_length], len(full)), *separate]


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]], max_length: int) -> tuple[list[int], list[int], int]:
    """(input_ids, loss_mask, untruncated length) of a conversation that renders as one sample."""
    return tokenize_samples(tokenizer, messages, max_length)[0]


def _reply_body(generated: list[int], ends: Collection[int]) -> list[int]:
    """The generated ids without the turn end the server may have returned with them."""
    return generated[:-1] if generated and generated[-1] in ends else list(generated)


def _ends(tokenizer: Any, ends: Collection[int] | None) -> frozenset[int]:
    """The ids that may close a reply: the template's turn ends (learned from it, not its eos:
    Kimi's eos is [EOS], its turns end with <|im_end|>) and the tokenizer's eos."""
    known = set(turn_ends(tokenizer) if ends is None else ends)
    if tokenizer.eos_token_id is not None:
        known.add(tokenizer.eos_token_id)
    return frozenset(known)


def exact_mismatch(tokenizer: Any, messages: list[dict[str, Any]], generated: list[int], ends: Collection[int] | None = None) -> bool:
    """Whether the last reply, re-tokenised by the template, differs from the ids the server
    generated. ``ends``: the template's turn ends (``turn_ends``), learned here if not given."""
    before = _render(tokenizer, messages[:-1], generation_prompt=True)
    span = _render(tokenizer, messages)[len(before) :]
    body = _reply_body(generated, _ends(tokenizer, ends))
    return span[: len(body)] != body


def with_exact_reply(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    sample: tuple[list[int], list[int], int],
    generated: list[int],
    max_length: int,
    ends: Collection[int] | None = None,
) -> tuple[list[int], list[int], int]:
    """The sample with its last reply as the ids the server generated (thinking included), where
    the template's re-tokenisation differs: the drafter learns what the target really produced.
    The reply is located up to the template's turn end (not the tokenizer's eos); what the
    template writes after that end (Qwen3's newline) stays, untrained: the target never wrote it."""
    ids, mask, _ = sample
    before = _render(tokenizer, messages[:-1], generation_prompt=True)
    full = _render(tokenizer, messages)
    known = _ends(tokenizer, ends)
    body = _reply_body(generated, known)
    span = full[len(before) :]
    closing = [i for i, token in enumerate(span) if token in known]
    if not body or span[: len(body)] == body or not closing or full[: len(before)] != before:
        return sample
    end = closing[-1]
    emitted = list(generated) if len(body) < len(generated) else [*body, span[end]]
    spliced = before + emitted + span[end + 1 :]
    spliced_mask = (mask + [0] * len(full))[: len(before)] + [1] * len(emitted) + [0] * (len(span) - end - 1)
    return spliced[:max_length], spliced_mask[:max_length], len(spliced)


def load_chat_tokenizer(target: TargetConfig) -> Any:
    tokenizer = load_target_tokenizer(target)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{target.tokenizer_path}: the tokenizer has no chat template")
    return tokenizer
