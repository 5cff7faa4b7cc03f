"""Each real target of the zoo from generate to prepare, in every thinking mode: a server answering
as that model does (its thinking split out by a parser, or left inline where the prompt opened
it), two-turn chats regenerated whole or only their last reply, and a chat that goes on after a
tool result. Every span
prepare trains is what the target emitted, and nothing else is."""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_config, read_jsonl, run_stage, trained_spans, write_jsonl
from tests.unit.test_target_formats import END, KEEP, NEEDS_TEXT_ARGUMENTS, OFF

# how a server hands each target's thinking back (without a parser, Kimi's and V3.1's replies
# carry the thinking the prompt opened, up to </think>, in the content)
SERVED_AS = {
    "qwen3-8b": "reasoning_content",
    "kimi-k2.5": "opened",
    "deepseek-v3.1": "opened",
    "gpt-oss-20b": "reasoning",
    "llama-3.1-8b-instruct": None,
}
REMOTE_CODE = {"kimi-k2.5"}
CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def _sources(tmp_path, form: str | None):
    think = f" [[think:{form}]]" if form else ""
    chats = [
        {
            "id": f"chat{i}",
            "conversations": [
                {"from": "human", "value": f"question {i}{think}"},
                {"from": "gpt", "value": "ANOTHER MODEL'S WORDS"},
                {"from": "human", "value": f"and then {i}?{think}"},
                {"from": "gpt", "value": "ANOTHER MODEL'S WORDS"},
            ],
        }
        for i in range(3)
    ]
    tools = [
        {
            "id": f"tool{i}",
            "messages": [
                {"role": "user", "content": f"Weather in Oslo, day {i}?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": CALL["id"], "content": f"rain, {i}C{think}"},
                {"role": "assistant", "content": "ANOTHER MODEL'S WORDS"},
            ],
        }
        for i in range(2)
    ]
    return write_jsonl(tmp_path / "chats.jsonl", chats), write_jsonl(tmp_path / "tools.jsonl", tools)


def _prepared_spans(config, tokenizer) -> list[str]:
    from safetensors.torch import load_file

    spans = []
    for shard in sorted(config.prepared_dir.glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        ids, mask, offsets = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist(), tensors["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:]):
            spans += trained_spans(tokenizer, ids[a:b], mask[a:b])
    return spans


def _expected(target: str, thinking: str, records: list[dict]) -> list[str]:
    spans = []
    for record in records:
        for k in record["target_turns"]:
            turn = record["conversations"][k]
            answer, thought = turn["content"], turn.get("reasoning_content")
            if thinking == "keep" and thought:
                spans.append(KEEP[target].format(r=thought, c=answer))
            elif thinking == "off" and not thought:
                spans.append(OFF[target].format(c=answer))
            else:  # dropped, or thought despite off (gpt-oss at low effort): context, not trained
                spans.append(f"{answer}{END[target]}")
    return spans


@pytest.mark.parametrize("thinking", ["keep", "drop", "off"])
@pytest.mark.parametrize("target", sorted(SERVED_AS))
async def test_generate_then_prepare_trains_what_the_target_emitted(tmp_path, zoo_model, fault_server, target, thinking):
    from transformers import AutoTokenizer

    from eagleops.pipeline.engine import Engine

    if target == "llama-3.1-8b-instruct" and thinking == "keep":
        pytest.skip("Llama-3.1 does not think; its template cannot show thinking (refusal tested in test_target_formats)")
    folder = zoo_model(target)
    chats, tools = _sources(tmp_path, SERVED_AS[target])
    datasets = [
        {"name": "chats", "path": str(chats), "format": "conversations", "token_budget": "1M", "regenerate": "all"},
        {"name": "tools", "path": str(tools), "format": "messages", "token_budget": "1M", "regenerate": "all"},
        {"name": "last", "path": str(chats), "format": "conversations", "token_budget": "1M", "regenerate": "last"},
    ]
    fault_server.reset()
    config = make_config(
        tmp_path,
        fault_server.base_url,
        datasets,
        thinking=thinking,
        target={"model": str(folder), "trust_remote_code": target in REMOTE_CODE},
        prepare={"draft_vocab_size": 32, "eval_fraction": 0.0},
    )
    assert (await Engine(config, stages=("generate",)).run()).ok
    run_stage(config, "prepare")  # its error, if any, raised here
    records = [r for name in ("chats", "tools", "last") for r in read_jsonl(config.output_dir / name / "data.jsonl")]
    if target in NEEDS_TEXT_ARGUMENTS:  # vLLM would refuse these requests: none is sent, each says why
        refused = read_jsonl(config.output_dir / "tools" / "failed.jsonl")
        assert len(refused) == 2 and all('can only concatenate str (not "dict")' in r["reason"] for r in refused)
        assert [len(r["target_turns"]) for r in records] == [2, 2, 2, 1, 1, 1]
    else:
        assert [len(r["target_turns"]) for r in records] == [2, 2, 2, 1, 1, 1, 1, 1]  # last: another model's reply stays history
    assert all(r["conversations"][1]["content"] == "ANOTHER MODEL'S WORDS" for r in records[-3:])
    assert all("ANOTHER MODEL" not in json.dumps(r["conversations"][k]) for r in records for k in r["target_turns"])
    if thinking != "off" and SERVED_AS[target]:
        assert all(r["conversations"][k].get("reasoning_content") for r in records for k in r["target_turns"])
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=target in REMOTE_CODE)
    assert sorted(_prepared_spans(config, tokenizer)) == sorted(_expected(target, thinking, records))
