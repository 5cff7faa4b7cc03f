"""The chat-template switch that turns the target's thinking on or off, learned from its template.

Templates name it differently: Qwen3 reads ``enable_thinking`` (thinks unless told not to),
Kimi-K2.5 reads ``thinking`` (the same), DeepSeek-V3.1 reads ``thinking`` but does **not** think
unless told to, gpt-oss cannot stop thinking and takes a ``reasoning_effort`` instead. Sending
the wrong name is silently ignored, so each candidate is tried: the one whose two values render
different generation prompts is the switch this template reads. Generate sends it (off for
``thinking = "off"``, on for ``keep`` and ``drop``) and prepare renders each prompt with the same
values, so a sample's prompt is the one the server rendered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import ConfigError
from eagleops.pipeline.formats.thinking import THINK_OPEN

__all__ = [
    "CANDIDATE_SWITCHES",
    "ThinkingSwitch",
    "learn_thinking_switch",
    "require_thinking_can_stop",
    "template_kwargs",
    "thinking_off_kwargs",
]


@dataclass(frozen=True)
class ThinkingSwitch:
    key: str
    off: Any
    on: Any  # None: a level with no "on"; the template's own default is left alone

    def kwargs(self, thinking: str) -> dict[str, Any]:
        if thinking == "off":
            return {self.key: self.off}
        return {} if self.on is None else {self.key: self.on}


# (name, value for off, value for on, a second value that must change the prompt)
CANDIDATE_SWITCHES = (
    ("enable_thinking", False, True, True),
    ("thinking", False, True, True),
    ("reasoning_effort", "low", None, "high"),
)

_PROBE = [{"role": "user", "content": "a question"}]


def _prompt(tokenizer: Any, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True, **kwargs)


def learn_thinking_switch(tokenizer: Any) -> ThinkingSwitch | None:
    """The switch this template reads; None where it reads none (Llama, Kimi-K2-Thinking)."""
    for key, off, on, other in CANDIDATE_SWITCHES:
        if _prompt(tokenizer, **{key: off}) != _prompt(tokenizer, **{key: other}):
            return ThinkingSwitch(key, off, on)
    return None


def thinking_off_kwargs(tokenizer: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` that turn thinking off in this template; None where it has no switch."""
    switch = learn_thinking_switch(tokenizer)
    return switch.kwargs("off") if switch else None


def template_kwargs(config: RunConfig, switch: ThinkingSwitch | None, thinking: str) -> dict[str, Any]:
    """The ``chat_template_kwargs`` generate sent for a dataset in this thinking mode: the run
    file's where it names them, else the template's own ``switch`` (the target profile's)."""
    given = config.sampling.thinking_off_kwargs if thinking == "off" else config.sampling.thinking_on_kwargs
    if given is not None:
        return dict(given)
    return switch.kwargs(thinking) if switch else {}


def require_thinking_can_stop(config: RunConfig, tokenizer: Any) -> None:
    """``thinking = "off"`` on a target whose template opens its thinking in every generation
    prompt, whatever it is sent, is refused: the target cannot answer without thinking, and
    training on what the template forces would teach the drafter a reply the target never gives."""
    off = [ds.name for ds in config.datasets if config.thinking_for(ds) == "off"]
    if not off:
        return
    given = template_kwargs(config, learn_thinking_switch(tokenizer), "off")
    if not _prompt(tokenizer, **given).rstrip().endswith(THINK_OPEN):
        return
    tried = ", ".join(f"{key}={off_value!r}" for key, off_value, _, _ in CANDIDATE_SWITCHES)
    target = config.target.tokenizer_path if config.target is not None else "the target"
    raise ConfigError(
        f'{config.source}: thinking = "off" (datasets {", ".join(off)}): the chat template of {target} opens {THINK_OPEN} in every '
        f"generation prompt{f' even with {given}' if given else ''} and reads no switch that stops it (tried {tried}): this target "
        'cannot answer without thinking. Use thinking = "keep" (its thinking trained) or "drop" (kept as context, not trained)'
    )
