"""The truth is the sequence the target processed: where the server returned the prompt's token
ids (vLLM's ``return_token_ids``), generate keeps them and prepare trains on them as they are,
counting the records whose template rendering differs (a template or tokenizer out of step with
the server's)."""

from __future__ import annotations

import json

from eagleops.pipeline.generate.replies import parse_reply
from tests.conftest import ml_config, run_stage, write_jsonl


def test_the_servers_prompt_ids_are_read_from_its_reply():
    body = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "token_ids": [7, 8]}],
        "usage": {"completion_tokens": 2},
    }
    reply = parse_reply(json.dumps(body).encode())
    assert reply.prompt_ids == (1, 2, 3) and reply.token_ids == (7, 8)
    assert parse_reply(json.dumps({**body, "prompt_token_ids": None}).encode()).prompt_ids is None


def test_prepare_trains_on_the_prompt_the_server_fed_the_target(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    config = ml_config(tmp_path, tiny_model, prepare={"draft_vocab_size": 64, "eval_fraction": 0.0})
    user = {"role": "user", "content": "explain the cache"}
    rendered = list(tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True)["input_ids"])
    # the server's own system prompt, which the record does not hold: its ids are the truth
    system = {"role": "system", "content": "be brief"}
    served = list(tokenizer.apply_chat_template([system, user], add_generation_prompt=True, tokenize=True)["input_ids"])
    reply = tokenizer.encode("the cache keeps tokens", add_special_tokens=False)
    records = [
        {"id": "a", "conversations": [user, {"role": "assistant", "content": "the cache keeps tokens"}], "target_turns": [1],
         "finish_reason": "length", "completion_token_ids": reply, "prompt_token_ids": served},
        {"id": "b", "conversations": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "because"}], "target_turns": [1],
         "finish_reason": "stop"},
    ]  # fmt: skip
    for name in ("B1", "B2"):
        (config.output_dir / name).mkdir(parents=True, exist_ok=True)
    write_jsonl(config.output_dir / "B1" / "data.jsonl", records)
    index = run_stage(config, "prepare")
    assert index.served_prompts == 1 and index.prompt_mismatches == 1
    from eagleops.pipeline.training.artifacts import load_prepared

    _, samples = load_prepared(config.prepared_dir)
    ids = [s[0].tolist() for s in samples]
    assert served + reply in ids and rendered + reply not in ids
