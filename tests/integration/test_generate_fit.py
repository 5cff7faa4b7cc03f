"""Generate pays for nothing prepare would drop: with a [target], a prompt too long to train a
reply after is skipped (or shortened, if asked) before it is sent, and no request asks for more
completion tokens than its sample has room for under ``[prepare] max_length``."""

from __future__ import annotations

import json
import random

from eagleops.pipeline.demo.tinymodel import sample_text
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.generate.fit import PromptFit, TooLong
from eagleops.pipeline.protocol.events import DatasetProgress
from tests.conftest import make_config, read_jsonl, run_stage, write_jsonl

MAX_LENGTH = 96


def _rows(rng: random.Random) -> list[dict]:
    """Short prompts, prompts far past MAX_LENGTH, and conversations whose early turns alone are."""
    rows = [{"id": f"short{i}", "prompt": sample_text(rng, 8)} for i in range(6)]
    rows += [{"id": f"long{i}", "prompt": sample_text(rng, 150)} for i in range(3)]
    history = [{"role": "user", "content": sample_text(rng, 120)}, {"role": "assistant", "content": sample_text(rng, 20)}]
    rows += [{"id": f"history{i}", "messages": [*history, {"role": "user", "content": sample_text(rng, 6)}]} for i in range(3)]
    return rows


def _config(tmp_path, base_url, tiny_model, long_prompts: str):
    source = write_jsonl(tmp_path / "rows.jsonl", _rows(random.Random(0)))
    dataset = {"name": "A", "path": str(source), "token_budget": 100_000, "long_prompts": long_prompts}
    return make_config(
        tmp_path, base_url, [dataset], sampling={"max_tokens": 64, "min_reply_tokens": 8},
        target={"model": str(tiny_model)}, prepare={"max_length": MAX_LENGTH, "draft_vocab_size": 64, "eval_fraction": 0.0},
        stages=["generate"],
    )  # fmt: skip


def _prompt_tokens(config, messages) -> int:
    from eagleops.pipeline.training.prepare.fit import prompt_counter

    return prompt_counter(config)(tuple(messages), None, "keep")


async def test_prompts_that_cannot_be_trained_are_skipped_before_any_token_is_paid(tmp_path, fault_server, tiny_model):
    fault_server.reset()
    config = _config(tmp_path, fault_server.base_url, tiny_model, "skip")
    summary = await Engine(config).run()
    (progress,) = summary.datasets
    records = read_jsonl(tmp_path / "out" / "A" / "data.jsonl")
    skipped = [r for r in read_jsonl(tmp_path / "out" / "A" / "failed.jsonl") if r["kind"] == "skipped"]
    assert sorted(r["id"] for r in skipped) == ["history0", "history1", "history2", "long0", "long1", "long2"]
    assert all("prompt too long to train" in r["reason"] and f"prepare.max_length {MAX_LENGTH}" in r["reason"] for r in skipped)
    assert fault_server.stats()["requests"] == len(records) == 6  # nothing was sent for the skipped rows
    assert progress.skipped == 6 and progress.failures == 0
    # each request asked for at most what its sample has room for
    asked = fault_server.stats()["max_tokens_asked"]
    for record in records:
        room = MAX_LENGTH - _prompt_tokens(config, record["conversations"][:-1])
        assert str(min(64, room)) in asked


async def test_drop_oldest_sends_the_later_turns_that_fit_and_records_them(tmp_path, fault_server, tiny_model):
    fault_server.reset()
    config = _config(tmp_path, fault_server.base_url, tiny_model, "drop-oldest")
    summary = await Engine(config).run()
    (progress,) = summary.datasets
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "A" / "data.jsonl")}
    assert progress.skipped == 3  # single long prompts have nothing to drop
    for i in range(3):
        shortened = records[f"history{i}"]
        assert shortened["dropped_messages"] == 2
        assert [m["role"] for m in shortened["conversations"]] == ["user", "assistant"]
        assert _prompt_tokens(config, shortened["conversations"][:-1]) + 8 <= MAX_LENGTH
    # prepare trains every reply that was paid for: nothing dropped, nothing cut
    index = run_stage(config, "prepare")
    assert index.samples == len(records) and index.truncated == 0


def test_a_fit_shortens_only_whole_exchanges_and_keeps_the_system_prompt():
    words = lambda messages, tools, thinking: sum(len(m["content"].split()) for m in messages)  # noqa: E731
    fit = PromptFit(words, max_length=20, min_reply=4, max_tokens=64)
    system = {"role": "system", "content": "be brief"}
    turns = (
        system,
        {"role": "user", "content": "a " * 10},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "b " * 5, "tool_call_id": "1"},
        {"role": "user", "content": "c " * 3},
    )
    fitted = fit.fit(turns, None, "keep", shorten=True)
    assert not isinstance(fitted, TooLong)
    assert fitted.messages == (system, turns[-1]) and fitted.dropped == 3 and fitted.max_tokens == 20 - 5
    assert isinstance(fit.fit(turns, None, "keep", shorten=False), TooLong)
    alone = fit.fit((system, {"role": "user", "content": "d " * 30}), None, "keep", shorten=True)
    assert isinstance(alone, TooLong) and "leaving 0 for the reply" in alone.reason


def test_the_skipped_count_reaches_the_wire():
    progress = DatasetProgress(name="A", state="running", tokens=1, budget=2, samples=1, skipped=4)  # type: ignore[arg-type]
    assert json.loads(json.dumps(progress.to_json()))["skipped"] == 4
