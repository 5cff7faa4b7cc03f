"""A reasoning target's replies: its thinking kept whichever field or inline form the server
used, turned off the way each server understands, counted in the budget and shown as a share."""

from __future__ import annotations

import copy
import json

import pytest

from eagleops.console.report import status_line
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.generate.replies import parse_reply, request_fields
from eagleops.pipeline.protocol.events import StopReason
from tests.conftest import builder_for, make_config, read_jsonl, trained_spans, write_jsonl

THOUGHT = "first I weigh the cases then I check the sum"


def _body(message: dict, usage: dict | None = None, **choice) -> bytes:
    return json.dumps({"choices": [{"message": message, "finish_reason": "stop", **choice}], "usage": usage or {}}).encode()


@pytest.mark.parametrize(
    "message",
    [
        {"content": "4", "reasoning": THOUGHT},  # vLLM, OpenRouter
        {"content": "4", "reasoning_content": THOUGHT},  # SGLang with --reasoning-parser
        {"content": f"<think>{THOUGHT}</think>\n\n4"},  # no parser: inline
    ],
)
def test_every_servers_thinking_is_found(message):
    reply = parse_reply(_body(message, {"completion_tokens": 12, "completion_tokens_details": {"reasoning_tokens": 10}}))
    assert (reply.text, reply.reasoning, reply.completion_tokens, reply.reasoning_tokens) == ("4", THOUGHT, 12, 10)


def test_token_ids_are_kept_and_an_answer_without_thinking_is_plain():
    reply = parse_reply(_body({"content": "no <think> here"}, {"completion_tokens": 3}, token_ids=[5, 6, 7]))
    assert reply.reasoning is None and reply.text == "no <think> here" and reply.token_ids == (5, 6, 7)


def test_thinking_off_is_asked_in_each_servers_dialect():
    generic = request_fields({"top_k": 5}, kind="auto", base_url="http://127.0.0.1:8000/v1", thinking="off")
    assert generic == {"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}}
    routed = request_fields({}, kind="auto", base_url="https://openrouter.ai/api/v1", thinking="off")
    assert routed == {"reasoning": {"enabled": False}}
    kept = request_fields({"chat_template_kwargs": {"x": 1}}, kind="vllm", base_url="http://h/v1", thinking="off")
    assert kept == {"chat_template_kwargs": {"x": 1, "enable_thinking": False}, "return_token_ids": True}
    assert "chat_template_kwargs" not in request_fields({}, kind="sglang", base_url="http://h/v1", thinking="keep")


async def test_kept_thinking_is_stored_counted_and_shown(tmp_path, fault_server):
    forms = {"V": "reasoning", "S": "reasoning_content", "I": "inline"}
    datasets = [
        {
            "name": name,
            "path": str(
                write_jsonl(tmp_path / f"{name}.jsonl", [{"id": f"{name}{i}", "prompt": f"q {i} [[think:{form}]]"} for i in range(5)])
            ),
            "token_budget": "1M",
        }
        for name, form in forms.items()
    ]
    config = make_config(tmp_path, fault_server.base_url, datasets)
    summary = await Engine(config).run()
    assert summary.ok
    for name in forms:
        records = read_jsonl(config.output_dir / name / "data.jsonl")
        assert len(records) == 5
        for record in records:
            reply = record["conversations"][-1]
            assert reply["reasoning_content"] == THOUGHT and "<think>" not in reply["content"]
            assert record["completion_tokens"] == 30 and record["reasoning_tokens"] == 10 and record["thinking"] == "keep"
        progress = next(d for d in summary.datasets if d.name == name)
        assert progress.tokens == 150 and progress.reasoning_tokens == 50  # the budget counts the thinking too
        assert "thinking 33%" in status_line(progress)


async def test_thinking_off_is_requested_and_nothing_is_stored(tmp_path, fault_server):
    fault_server.reset()
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": f"q {i} [[think:reasoning]]"} for i in range(4)])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M", "thinking": "off"}])
    summary = await Engine(config).run()
    assert summary.ok and fault_server.stats()["thinking_off"] == 4
    for record in read_jsonl(config.output_dir / "A" / "data.jsonl"):
        assert "reasoning_content" not in record["conversations"][-1] and record["thinking"] == "off" and record["reasoning_tokens"] == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def builder(tokenizer, tiny_model):
    return builder_for(tokenizer, tiny_model)


def _with_template(builder, template: str):
    """A builder for the same tokenizer under another chat template."""
    tokenizer = copy.deepcopy(builder.tokenizer)
    tokenizer.chat_template = template
    return builder_for(tokenizer)


ANSWER = [{"role": "user", "content": "add two and two"}, {"role": "assistant", "content": "four", "reasoning_content": THOUGHT}]


def test_kept_thinking_is_trained_as_the_target_wrote_it(builder, tokenizer):
    [sample] = builder.build(ANSWER, None, "keep")
    assert trained_spans(tokenizer, sample.ids, sample.mask) == [f"<think>\n{THOUGHT}\n</think>\n\nfour<|eot_id|>"]


def test_dropped_thinking_stays_as_context_and_is_not_trained_on(builder, tokenizer):
    [sample] = builder.build(ANSWER, None, "drop")
    assert trained_spans(tokenizer, sample.ids, sample.mask) == ["four<|eot_id|>"]
    assert THOUGHT in tokenizer.decode(sample.ids)  # the answer was written after it


def test_each_reply_is_the_sequence_the_target_processed(builder, tokenizer):
    """The template drops earlier thinking from the history (as Qwen3's does): each reply is a
    sample of its own, its prompt the history the server rendered when the target wrote it."""
    messages = [
        {"role": "user", "content": "add two and two"},
        {"role": "assistant", "content": "four", "reasoning_content": "two plus two"},
        {"role": "user", "content": "and three more"},
        {"role": "assistant", "content": "seven", "reasoning_content": "four and three"},
    ]
    first, second = builder.build(messages, None, "keep")
    assert trained_spans(tokenizer, first.ids, first.mask) == ["<think>\ntwo plus two\n</think>\n\nfour<|eot_id|>"]
    assert trained_spans(tokenizer, second.ids, second.mask) == ["<think>\nfour and three\n</think>\n\nseven<|eot_id|>"]
    assert "two plus two" not in tokenizer.decode(second.ids)  # the history as the server rendered it


VERBATIM = (  # renders content as given: nothing says how the target writes its thinking
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_kept_thinking_a_template_cannot_show_is_refused_unless_the_servers_ids_say_how(builder, tokenizer):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    verbatim = _with_template(builder, VERBATIM)
    with pytest.raises(PrepareError, match='shows no thinking.*thinking = "drop"'):
        verbatim.build(ANSWER, None, "keep")
    emitted = tokenizer.encode(f"<think>{THOUGHT}</think>four", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    [sample] = verbatim.build(ANSWER, None, "keep", exact=emitted)
    assert sample.ids[-len(emitted) :] == emitted and trained_spans(tokenizer, sample.ids, sample.mask) == [tokenizer.decode(emitted)]
    [dropped] = verbatim.build(ANSWER, None, "drop")  # not trained, and no place for it: left out
    assert trained_spans(tokenizer, dropped.ids, dropped.mask) == ["four<|eot_id|>"] and THOUGHT not in tokenizer.decode(dropped.ids)


def test_the_template_that_cuts_thinking_at_its_close_tells_the_format(builder, tokenizer):
    """A template that renders no thinking but cuts it off at </think> (DeepSeek-R1 and V3.1
    do) says the target closes its thinking with that tag."""
    cutting = (
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'].split('</think>')[-1] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    [sample] = _with_template(builder, cutting).build(ANSWER, None, "keep")
    assert trained_spans(tokenizer, sample.ids, sample.mask) == [f"<think>{THOUGHT}</think>four<|eot_id|>"]


def test_replies_whose_server_ids_differ_from_the_rebuilt_ones_are_counted(tokenizer, tiny_model):
    builder = builder_for(tokenizer, tiny_model)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache keeps tokens"}]
    same = tokenizer.encode("the cache keeps tokens", add_special_tokens=False) + [tokenizer.eos_token_id]
    builder.build(messages, None, "keep", exact=same)
    assert builder.exact_mismatches == 0
    builder.build(messages, None, "keep", exact=[tokenizer.encode("x", add_special_tokens=False)[0], *same])
    assert builder.exact_mismatches == 1


def _exchanges(n: int, tag: str = "") -> dict:
    turns = []
    for k in range(3):
        turns.append({"from": "human", "value": f"question {k} of {n} {tag}"})
        if k < 2:
            turns.append({"from": "gpt", "value": "ANOTHER MODEL'S WORDS"})
    return {"id": f"c{n}", "conversations": turns}


async def test_every_assistant_turn_is_regenerated_in_order(tmp_path, fault_server):
    fault_server.reset()
    source = write_jsonl(tmp_path / "c.jsonl", [_exchanges(n, "[[think:reasoning_content]]") for n in range(4)])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "C", "path": str(source), "token_budget": "1M", "regenerate": "all"}])
    summary = await Engine(config).run()
    assert summary.ok and fault_server.stats()["completed"] == 12  # three replies a conversation
    for record in read_jsonl(config.output_dir / "C" / "data.jsonl"):
        turns = record["conversations"]
        assert [t["role"] for t in turns] == ["user", "assistant"] * 3
        assert all("ANOTHER MODEL" not in t["content"] for t in turns)
        assert all(t["reasoning_content"] == THOUGHT for t in turns[1::2])
        assert record["target_turns"] == [1, 3, 5] and record["completion_tokens"] == 3 * 30 and record["reasoning_tokens"] == 30
    assert summary.datasets[0].tokens == 4 * 90


CALL = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]


async def test_tool_calls_pass_through_and_only_the_targets_replies_are_marked(tmp_path, fault_server):
    fault_server.reset()
    row = {
        "id": "t1",
        "messages": [
            {"role": "user", "content": "add two and two"},
            {"role": "assistant", "content": None, "tool_calls": CALL},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            {"role": "assistant", "content": "ANOTHER MODEL'S WORDS"},
            {"role": "user", "content": "thanks"},
        ],
    }
    source = write_jsonl(tmp_path / "t.jsonl", [row])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "T", "path": str(source), "token_budget": "1M", "regenerate": "all"}])
    assert (await Engine(config).run()).ok
    [record] = read_jsonl(config.output_dir / "T" / "data.jsonl")
    turns = record["conversations"]
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": CALL}  # a call stays as it was
    assert turns[2] == {"role": "tool", "content": "4", "tool_call_id": "call_1"}
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert record["target_turns"] == [3, 5] and "ANOTHER MODEL" not in json.dumps(turns)


def test_prepare_trains_only_on_the_turns_the_target_wrote(builder, tokenizer):
    messages = [
        {"role": "user", "content": "add two and two"},
        {"role": "assistant", "content": "ANOTHER MODEL"},  # kept as history by regenerate = last
        {"role": "user", "content": "and three more"},
        {"role": "assistant", "content": "seven"},
    ]
    [sample] = builder.build(messages, [3], "keep")
    assert trained_spans(tokenizer, sample.ids, sample.mask) == ["seven<|eot_id|>"]


def test_the_servers_ids_are_trained_where_they_tokenise_differently(builder, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache keeps tokens"}]
    # the same text, split into other tokens than a re-tokenisation would give
    generated = [tok for ch in "the cache keeps tokens" for tok in tokenizer.encode(ch, add_special_tokens=False)]
    [sample] = builder.build(messages, None, "keep", exact=[*generated, tokenizer.eos_token_id])
    assert sample.ids[-len(generated) - 1 : -1] == generated and sample.mask[-len(generated) - 1 :] == [1] * (len(generated) + 1)


def _long_conversations(count: int, turns: int, tokens: int) -> list[dict]:
    return [
        {
            "id": f"c{i}",
            "conversations": [
                turn
                for k in range(turns)
                for turn in ({"from": "human", "value": f"q{k} of {i} [[tokens:{tokens}]]"}, {"from": "gpt", "value": "old"})
            ],
        }
        for i in range(count)
    ]


async def test_regenerate_all_overshoots_the_budget_by_at_most_what_is_in_flight(tmp_path, fault_server):
    """A conversation reserves its remaining replies and asks for none once the budget is reached:
    the bound is the README's, requests in flight x max_tokens (here 8 x 64)."""
    fault_server.reset()
    source = write_jsonl(tmp_path / "c.jsonl", _long_conversations(30, turns=10, tokens=40))
    dataset = {"name": "C", "path": str(source), "token_budget": 100, "regenerate": "all"}
    summary = await Engine(make_config(tmp_path, fault_server.base_url, [dataset], concurrency=8)).run()
    (progress,) = summary.datasets
    assert progress.stopped_by == StopReason.BUDGET and 100 <= progress.tokens <= 100 + 8 * 64
    for record in read_jsonl(tmp_path / "out" / "C" / "data.jsonl"):  # cut short, a record still ends in the target's reply
        turns = record["conversations"]
        assert turns[-1]["role"] == "assistant" and record["target_turns"][-1] == len(turns) - 1
        assert all(turns[i]["role"] == "assistant" and turns[i]["content"] != "old" for i in record["target_turns"])


async def test_regenerate_all_answers_a_last_tool_result_and_names_a_row_with_nothing_to_answer(tmp_path, fault_server):
    fault_server.reset()
    asks = {"role": "user", "content": "add two and two"}
    calls = {"role": "assistant", "content": None, "tool_calls": CALL}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    source = write_jsonl(tmp_path / "t.jsonl", [{"id": "r", "messages": [asks, calls, result]}, {"id": "c", "messages": [asks, calls]}])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "T", "path": str(source), "token_budget": "1M", "regenerate": "all"}])
    (progress,) = (await Engine(config).run()).datasets
    [record] = read_jsonl(config.output_dir / "T" / "data.jsonl")
    assert record["id"] == "r" and record["target_turns"] == [3] and record["conversations"][3]["role"] == "assistant"
    [failure] = read_jsonl(config.output_dir / "T" / "failed.jsonl")
    assert failure["kind"] == "bad_line" and failure["source_line"] == 2 and failure["field"] == "messages"
    assert "nothing for the target to write" in failure["reason"] and progress.bad_lines == 1
