"""The chat-template switch that turns the target's thinking off, learned from its template.

Templates name it differently: Qwen3 reads ``enable_thinking``, Kimi-K2.5 and DeepSeek-V3.1 read
``thinking``. Sending the wrong one is silently ignored and the target thinks anyway, so each
candidate is tried: the one whose false and true values render different generation prompts is
the switch this template reads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeline.config import RunConfig

__all__ = ["CANDIDATE_SWITCHES", "thinking_off_kwargs", "with_target_thinking_switch"]

CANDIDATE_SWITCHES = ("enable_thinking", "thinking")

_PROBE = [{"role": "user", "content": "a question"}]


def _prompt(tokenizer: Any, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True, **kwargs)


def thinking_off_kwargs(tokenizer: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` that turn thinking off in this template; None where no candidate
    changes its generation prompt (a template without a switch, or one that takes a reasoning
    effort, as gpt-oss's does)."""
    for switch in CANDIDATE_SWITCHES:
        if _prompt(tokenizer, **{switch: False}) != _prompt(tokenizer, **{switch: True}):
            return {switch: False}
    return None


def with_target_thinking_switch(config: RunConfig) -> RunConfig:
    """The run with ``[sampling] thinking_off_kwargs`` learned from ``[target]``'s template where
    a dataset turns thinking off and the run file does not say which switch to send. Learned
    here, where the target is known, and handed to generate as plain data: generate stays free of
    transformers."""
    wanted = any(config.thinking_for(dataset) == "off" for dataset in config.datasets)
    if not wanted or config.target is None or config.sampling.thinking_off_kwargs is not None:
        return config
    from pipeline.training.modeling.target import load_target_tokenizer

    switch = thinking_off_kwargs(load_target_tokenizer(config.target))
    if switch is None:
        return config
    return replace(config, sampling=replace(config.sampling, thinking_off_kwargs=switch))
