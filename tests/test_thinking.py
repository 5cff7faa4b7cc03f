"""A reasoning target's replies: its thinking kept whichever field or inline form the server
used, turned off the way each server understands, counted in the budget and shown as a share."""

from __future__ import annotations

import json

import pytest

from pipeline.engine import Engine
from pipeline.generate.replies import parse_reply, request_fields
from pipeline.protocol.events import StopReason
from pipeline.protocol.report import status_line

from .conftest import make_config, read_jsonl, write_jsonl

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


def _spans(tok, ids, mask) -> list[str]:
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.mark.slow
def test_kept_thinking_is_rendered_by_the_template_and_trained_on(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples

    messages = [{"role": "user", "content": "add two and two"}, {"role": "assistant", "content": "four", "reasoning_content": THOUGHT}]
    [(ids, mask, _)] = tokenize_samples(tokenizer, messages, 4096)
    assert _spans(tokenizer, ids, mask) == [f"<think>\n{THOUGHT}\n</think>\n\nfour<|eot_id|>"]


@pytest.mark.slow
def test_dropped_thinking_is_not_trained_on(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples
    from pipeline.training.prepare.inputs import _turn

    reply = {"role": "assistant", "content": "four", "reasoning_content": THOUGHT}
    messages = [{"role": "user", "content": "add two and two"}, _turn(reply, keep_thinking=False)]
    [(ids, mask, _)] = tokenize_samples(tokenizer, messages, 4096)
    assert _spans(tokenizer, ids, mask) == ["four<|eot_id|>"]


@pytest.mark.slow
def test_a_template_that_drops_earlier_thinking_gives_that_turn_a_sample_of_its_own(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples

    messages = [
        {"role": "user", "content": "add two and two"},
        {"role": "assistant", "content": "four", "reasoning_content": "two plus two"},
        {"role": "user", "content": "and three more"},
        {"role": "assistant", "content": "seven", "reasoning_content": "four and three"},
    ]
    (full, full_mask, _), (own, own_mask, _) = tokenize_samples(tokenizer, messages, 4096)
    assert _spans(tokenizer, full, full_mask) == ["<think>\nfour and three\n</think>\n\nseven<|eot_id|>"]
    assert "two plus two" not in tokenizer.decode(full)  # the history as the template renders it
    assert _spans(tokenizer, own, own_mask) == ["<think>\ntwo plus two\n</think>\n\nfour<|eot_id|>"]


@pytest.mark.slow
def test_a_template_that_keeps_thinking_in_the_content_gets_it_inline(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples

    inline = (  # no reasoning field: thinking travels inside the content, as <think> blocks
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    messages = [{"role": "user", "content": "add two and two"}, {"role": "assistant", "content": "four", "reasoning_content": THOUGHT}]
    original, tokenizer.chat_template = tokenizer.chat_template, inline
    try:
        [(ids, mask, _)] = tokenize_samples(tokenizer, messages, 4096)
    finally:
        tokenizer.chat_template = original
    assert _spans(tokenizer, ids, mask) == [f"<think>\n{THOUGHT}\n</think>\n\nfour<|eot_id|>"]


@pytest.mark.slow
def test_a_template_that_cannot_render_thinking_is_refused(tokenizer):
    from pipeline.training.prepare.chat_template import PrepareError, tokenize_samples

    plain = (  # strips thinking wherever it is, as DeepSeek-R1's template does
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'].split('</think>')[-1] }}<|eot_id|>{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": THOUGHT}]
    original, tokenizer.chat_template = tokenizer.chat_template, plain
    try:
        tokenize_samples(tokenizer, messages, 4096)
    except PrepareError as exc:
        assert "renders no thinking" in str(exc)
    else:
        raise AssertionError("a template that ignores reasoning_content was accepted")
    finally:
        tokenizer.chat_template = original


@pytest.mark.slow
def test_replies_that_re_tokenise_differently_are_counted(tokenizer):
    from pipeline.training.prepare.chat_template import exact_mismatch

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache keeps tokens"}]
    generated = tokenizer.encode("the cache keeps tokens", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert not exact_mismatch(tokenizer, messages, generated)
    assert exact_mismatch(tokenizer, messages, [tokenizer.encode("x", add_special_tokens=False)[0], *generated])


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


@pytest.mark.slow
def test_prepare_trains_only_on_the_turns_the_target_wrote(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples

    messages = [
        {"role": "user", "content": "add two and two"},
        {"role": "assistant", "content": "ANOTHER MODEL"},  # kept as history by regenerate = last
        {"role": "user", "content": "and three more"},
        {"role": "assistant", "content": "seven"},
    ]
    [(ids, mask, _)] = tokenize_samples(tokenizer, messages, 4096, trained=[3])
    assert _spans(tokenizer, ids, mask) == ["seven<|eot_id|>"]


@pytest.mark.slow
def test_the_generated_ids_replace_a_reply_that_re_tokenises_differently(tokenizer):
    from pipeline.training.prepare.chat_template import tokenize_samples, with_exact_reply

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache keeps tokens"}]
    rendered = tokenize_samples(tokenizer, messages, 4096)[0]
    # the same text, split into other tokens than the template's re-tokenisation would give
    generated = [tok for piece in ("the", " cache", " keeps", " tokens") for tok in tokenizer.encode(piece, add_special_tokens=False)]
    generated = [*sum((tokenizer.encode(ch, add_special_tokens=False) for ch in "the cache"), []), *generated[2:], tokenizer.eos_token_id]
    ids, mask, _ = with_exact_reply(tokenizer, messages, rendered, generated, 4096)
    assert ids[-len(generated) :] == generated and mask[-len(generated) :] == [1] * len(generated)
    assert tokenizer.decode(ids) == tokenizer.decode(rendered[0])  # the same text, the generated tokens


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
