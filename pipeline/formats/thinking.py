"""Thinking written inline, between ``<think>`` tags, and how to split it from the answer.

Servers without a reasoning parser leave the thinking in the content, and even with one a reply
can carry thinking the parser missed. Every form seen in the wild is split here, once, so that
no tag and no thought stays in the answer (which ``drop`` and ``off`` train on):

* ``<think>thought</think>answer``: the classic block;
* ``thought</think>answer``: the generation prompt opened the block (DeepSeek-R1, V3.1, Kimi);
* ``<think>thought`` with no close: cut at ``max_tokens`` (or stopped) while still thinking;
* a second block, or a block nested in another: everything up to the last close is thinking;
* a reasoning field from the server *and* a block left in the content: both are thinking.
"""

from __future__ import annotations

__all__ = ["THINK_CLOSE", "THINK_OPEN", "split_thinking"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _unwrapped(thought: str) -> str:
    """The thought without its opening tag (and the tags of blocks nested in it)."""
    return thought.replace(THINK_OPEN, "").replace(THINK_CLOSE, "").strip()


def split_thinking(content: str, reasoning: str | None = None) -> tuple[str, str | None]:
    """(answer, thinking) of a reply whose ``content`` may still hold thinking inline;
    ``reasoning``: what the server already split out, if anything. The thinking is stripped
    of the whitespace around it (the templates write their own)."""
    thoughts = [reasoning.strip()] if reasoning and reasoning.strip() else []
    answer = content
    if THINK_CLOSE in content:
        before, _, answer = content.rpartition(THINK_CLOSE)
        answer = answer.lstrip("\n")
        if _unwrapped(before):
            thoughts.append(_unwrapped(before))
    elif content.lstrip().startswith(THINK_OPEN):  # never closed: the reply stopped mid-thought
        answer = ""
        if _unwrapped(content):
            thoughts.append(_unwrapped(content))
    return answer, "\n\n".join(thoughts) if thoughts else None
