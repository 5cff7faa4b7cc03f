"""The ML stages on the tiny real target: prepare -> extract -> train -> export -> eval."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagleops.pipeline.engine import Engine
from eagleops.pipeline.protocol.events import StageStatus
from eagleops.pipeline.training.context import StageContext, StageKilled
from eagleops.pipeline.training.prepare.vocab import build_draft_vocab
from tests.conftest import KillAt, builder_for
from tests.conftest import ml_config as _config
from tests.conftest import run_stage as _stage

ROOT = Path(__file__).resolve().parents[2]


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "explain the cache"},
        {"role": "assistant", "content": "the cache keeps tokens"},
        {"role": "user", "content": "and the drafter?"},
        {"role": "assistant", "content": "it guesses ahead"},
    ]
    [sample] = builder_for(tok, tiny_model).build(messages, None, "keep")
    ids, mask = sample.ids, sample.mask
    assert len(ids) == len(mask)
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [tok.decode(s) for s in spans] == ["the cache keeps tokens<|eot_id|>", "it guesses ahead<|eot_id|>"]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "explain the cache" in unmasked and "be brief" in unmasked and "guesses" not in unmasked


def test_draft_vocab_mapping():
    counts = Counter({5: 10, 2: 7, 9: 7, 1: 1})
    draft_ids, d2t, t2d = build_draft_vocab(counts, vocab_size=12, draft_size=3)
    assert draft_ids == [2, 5, 9]  # most frequent, ties by id, sorted
    assert [i + d2t[i] for i in range(3)] == draft_ids
    assert [i for i, on in enumerate(t2d) if on] == draft_ids
    padded, _, _ = build_draft_vocab(Counter({7: 3}), vocab_size=12, draft_size=4)
    assert padded == [0, 1, 2, 7]  # fewer seen than asked for: unseen ids fill in


def test_prepare_dedupes_holds_out_and_writes_shards(workdir, tiny_model):
    config = _config(workdir, tiny_model)
    # the same prompt twice across datasets: kept once
    first = (workdir / "out" / "B1" / "data.jsonl").read_text().splitlines()[0]
    with open(workdir / "out" / "B2" / "data.jsonl", "a") as f:
        f.write(first + "\n")
    index = _stage(config, "prepare")
    b1 = len((workdir / "out" / "B1" / "data.jsonl").read_text().splitlines())
    b2 = len((workdir / "out" / "B2" / "data.jsonl").read_text().splitlines())
    assert index.duplicates_dropped == 1
    assert index.samples + index.held_out == b1 + b2 - 1
    assert index.draft_vocab_size == 256
    held_out = [json.loads(line) for line in (config.prepared_dir / "eval.jsonl").read_text().splitlines()]
    assert len(held_out) == index.held_out and all(m["messages"][-1]["role"] == "user" for m in held_out)
    again = _stage(config, "prepare")  # unchanged inputs: skipped
    assert again.fingerprint == index.fingerprint


def test_prepare_takes_pre_tokenized_extra_sets(workdir, tiny_model):
    extra = workdir / "extra.jsonl"
    extra.write_text("".join(json.dumps({"input_ids": [0, 5, 6, 7, 1], "loss_mask": [0, 0, 1, 1, 1]}) + "\n" for _ in range(7)))
    plain = _stage(_config(workdir, tiny_model), "prepare")
    with_extra = _stage(_config(workdir, tiny_model, prepare={"extra": [str(extra)]}), "prepare")
    assert with_extra.samples == plain.samples + 7
    extra.write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    with pytest.raises(PrepareError, match=r"extra.jsonl:1: input_ids and loss_mask must be integer lists of equal length"):
        _stage(_config(workdir, tiny_model, prepare={"extra": [str(extra)], "seed": 1}), "prepare")


def test_bad_generated_line_names_file_and_line(workdir, tiny_model):
    config = _config(workdir, tiny_model)
    with open(workdir / "out" / "B2" / "data.jsonl", "a") as f:
        f.write('{"id": "x", "conversations": [{"role": "user", "content": "hi"}]}\n')
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    with pytest.raises(PrepareError, match=r"B2/data.jsonl:\d+: conversations: must end with an assistant turn"):
        _stage(config, "prepare")


def test_extracted_states_equal_a_direct_forward(workdir, tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = _config(workdir, tiny_model)
    _stage(config, "prepare")
    index = _stage(config, "extract")
    assert index.aux_layers == [1, 3, 4]  # [1, N//2-1, N-4] for the 8-layer target
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    shard = load_file(str(config.features_dir / "shard-00001.safetensors"))
    offsets = shard["offsets"].tolist()
    for j in (0, 5, len(offsets) - 2):
        a, b = offsets[j], offsets[j + 1]
        ids = shard["input_ids"][a:b].long()[None]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        expected_aux = torch.cat([out.hidden_states[layer + 1] for layer in (1, 3, 4)], dim=-1)[0]
        expected_final = out.hidden_states[-1][0]
        torch.testing.assert_close(shard["aux"][a:b].float(), expected_aux.bfloat16().float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(shard["final"][a:b].float(), expected_final.bfloat16().float(), rtol=2e-2, atol=2e-2)
        assert shard["aux"].dtype == torch.bfloat16
    metrics = index.metrics
    assert metrics["bytes_per_token"] < metrics["all_layers_bytes_per_token"]


def test_device_map_spreads_the_target_and_computes_the_same(tiny_model):
    from eagleops.pipeline.config import TargetConfig
    from eagleops.pipeline.training.extract.hf import forward_features
    from eagleops.pipeline.training.modeling.target import load_target

    rows = [torch.tensor([1, 5, 9, 33, 7]), torch.tensor([1, 8, 2])]
    plain, device, _ = load_target(TargetConfig(model=tiny_model))
    spread, spread_device, _ = load_target(TargetConfig(model=tiny_model, device_map="auto"))
    for ours, theirs in zip(forward_features(plain, rows, (1, 3, 4), device), forward_features(spread, rows, (1, 3, 4), spread_device)):
        torch.testing.assert_close(ours, theirs)


def test_extract_resumes_after_a_kill_with_identical_shards(workdir, tiny_model, tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    shutil.copytree(workdir / "data", reference / "data")
    shutil.copytree(workdir / "out", reference / "out")
    full = _config(reference, tiny_model)
    _stage(full, "prepare")
    _stage(full, "extract")

    config = _config(workdir, tiny_model)
    _stage(config, "prepare")
    with pytest.raises(StageKilled):
        _stage(config, "extract", KillAt("extract", 9))
    partial = json.loads((config.features_dir / "index.json").read_text())
    assert 0 < len(partial["shards"]) < len(json.loads((full.features_dir / "index.json").read_text())["shards"])
    assert not list(config.features_dir.glob("*.tmp"))
    _stage(config, "extract")
    names = sorted(p.name for p in full.features_dir.glob("shard-*.safetensors"))
    assert names == sorted(p.name for p in config.features_dir.glob("shard-*.safetensors"))
    for name in names:
        assert (config.features_dir / name).read_bytes() == (full.features_dir / name).read_bytes(), name


def test_train_resumes_from_a_checkpoint_on_the_same_loss_curve(workdir, tiny_model, tmp_path_factory):
    straight_dir = tmp_path_factory.mktemp("straight")
    shutil.copytree(workdir / "out", straight_dir / "out")
    shutil.copytree(workdir / "data", straight_dir / "data")
    base = _config(workdir, tiny_model, train={"max_steps": 30, "checkpoint_every": 10})
    _stage(base, "prepare")
    _stage(base, "extract")
    shutil.rmtree(straight_dir / "out")
    shutil.copytree(workdir / "out", straight_dir / "out")
    straight = _config(straight_dir, tiny_model, train={"max_steps": 30, "checkpoint_every": 10})
    _stage(straight, "train")
    with pytest.raises(StageKilled):
        _stage(base, "train", KillAt("train", 16))  # dies during step 16: checkpoint has 15
    resumed = _stage(base, "train")
    assert resumed.steps == 30
    curve = [json.loads(line)["loss"] for line in (base.train_dir / "history.jsonl").read_text().splitlines()]
    expected = [json.loads(line)["loss"] for line in (straight.train_dir / "history.jsonl").read_text().splitlines()]
    assert len(curve) == len(expected) == 30
    assert curve == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(900)  # several torchrun jobs: a loaded 2-core machine runs them 4x slower
def test_torchrun_two_processes_on_cpu(workdir, tiny_model):
    config = _config(workdir, tiny_model, train={"max_steps": 12, "checkpoint_every": 6})
    _stage(config, "prepare")
    _stage(config, "extract")
    run = workdir / "run.toml"
    run.write_text(
        f'name = "ddp"\noutput_dir = "{workdir / "out"}"\n[[endpoints]]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
        f'[[datasets]]\nname = "B1"\npath = "{workdir / "data" / "sharegpt.jsonl"}"\ntoken_budget = 1\n'
        f'[target]\nmodel = "{tiny_model}"\n[train]\nmax_steps = 12\nbatch_size = 2\nttt_length = 3\nlr = 3e-3\ncheckpoint_every = 6\nlog_every = 4\n'
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "eagleops", "train", str(run)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "world_size 2" in result.stdout
    state = torch.load(workdir / "out" / "train" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 12


def test_end_to_end_trained_drafter_beats_an_untrained_one(workdir, tiny_model):
    from safetensors import safe_open

    from eagleops.pipeline.training.eval.stage import evaluate
    from tests.unit.test_benchmarks import benchmark_tables

    config = _config(workdir, tiny_model, eval={"benchmarks": benchmark_tables()})
    engine = Engine(config, stages=("prepare", "extract", "train", "export", "eval"))
    summary = asyncio.run(engine.run())
    assert all(summary.stages[s] == StageStatus.DONE for s in ("prepare", "extract", "train", "export", "eval")), summary.stages
    trained = engine.stage_results["eval"]
    # every benchmark decoded, turn by turn, each with the target's own greedy output, reported apart
    table = json.loads((config.output_dir / "eval.json").read_text())["benchmarks"]
    assert [(r["benchmark"], r["prompts"]) for r in table] == [
        ("held-out", trained.prompts),
        ("MT-Bench", 2),
        ("GSM8K", 2),
        ("HumanEval", 2),
        ("MATH500", 2),
    ]
    assert all(r["verify_steps"] > 0 and r["greedy_mismatches"] == 0 and len(r["acceptance_rate_per_position"]) == 4 for r in table)
    assert json.loads((config.export_dir / "eval_benchmarks.json").read_text())["benchmarks"] == table
    untrained = evaluate(config, StageContext("eval"), untrained=True)
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board = event_accumulator.EventAccumulator(str(config.train_dir / "tensorboard"))
    board.Reload()
    assert {"loss", "lr", "tokens_per_s", "acc/ttt_0", "step_loss/ttt_3", "eval/acceptance_length", "eval/MT-Bench/acceptance_length",
            "eval/HumanEval/accept_rate_p1"} <= set(board.Tags()["scalars"])  # fmt: skip
    assert board.Scalars("eval/acceptance_length")[-1].value == pytest.approx(trained.acceptance_length, rel=1e-6)

    # the export is what SGLang loads: config + safetensors with its key names, no embeddings
    exported = json.loads((config.export_dir / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported["num_hidden_layers"] == 1 and exported["draft_vocab_size"] == 256
    # the outputs of layers 1, 3, 4: SGLang counts outputs, vLLM counts inputs (each reads its own key)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    speculators = json.loads((config.export_dir.with_name("drafter-speculators") / "config.json").read_text())
    assert speculators["speculators_config"]["verifier"]["name_or_path"] == str(tiny_model)
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and "model_type" not in speculators
    with safe_open(str(config.export_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
    } <= keys
    assert not any("embed" in k for k in keys)

    print(f"acceptance: trained {trained.acceptance_length}, untrained {untrained.acceptance_length}")
    # a real learning signal, and greedy verification keeps the target's own output
    assert trained.greedy_mismatches == 0 and untrained.greedy_mismatches == 0
    assert untrained.acceptance_length < 1.3
    assert trained.acceptance_length > untrained.acceptance_length + 0.5, (trained, untrained)
    assert trained.acceptance_rate_per_position[0] > 0.4


def test_the_target_head_in_chunks_equals_the_whole_head():
    from eagleops.pipeline.training.train.loss import target_top_and_draft_probs

    generator = torch.Generator().manual_seed(0)
    final = torch.randn(2, 9, 16, generator=generator)
    head = torch.randn(1000, 16, generator=generator)
    head[700] = head[3]  # a tie across chunks: argmax over the whole vocabulary takes the lower id
    final[0, 0] = head[3] * 10  # ... and this position's top is that tie
    draft_ids = torch.tensor([3, 5, 700, 999])
    logits = final @ head.T
    top, probs = logits.argmax(-1), torch.softmax(logits[..., draft_ids], dim=-1)
    assert top[0, 0] == 3
    for chunk in (0, 1, 7, 256, 699, 700, 1000, 5000):
        chunked_top, chunked_probs = target_top_and_draft_probs(final, head, head[draft_ids], chunk)
        assert torch.equal(chunked_top, top), chunk
        assert torch.allclose(chunked_probs, probs, atol=1e-6), chunk


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory) -> Path:
    """The real users' target's architecture at tiny size: DeepSeek-V3 (MLA, shared + routed experts), sharded."""
    from eagleops.pipeline.demo.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-deepseek-v3", architecture="deepseek_v3", layers=4, pretrain_steps=60)


def test_a_deepseek_v3_moe_target_goes_through_every_stage(workdir, moe_target):
    from transformers import AutoModelForCausalLM

    from eagleops.pipeline.config import TargetConfig
    from eagleops.pipeline.training.modeling.profile import head_and_embeddings, learn_profile

    assert json.loads((moe_target / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert len(json.loads((moe_target / "model.safetensors.index.json").read_text())["weight_map"]) > 20  # sharded
    head, embed = head_and_embeddings(learn_profile(TargetConfig(model=moe_target)))  # from the shards, without the model
    model = AutoModelForCausalLM.from_pretrained(str(moe_target))
    assert torch.equal(head, model.lm_head.weight) and torch.equal(embed, model.get_input_embeddings().weight)
    config = _config(workdir, moe_target, train={"epochs": 1, "max_steps": 40})
    engine = Engine(config, stages=("prepare", "extract", "train", "export", "eval"))
    summary = asyncio.run(engine.run())
    assert all(summary.stages[s] == StageStatus.DONE for s in ("prepare", "extract", "train", "export", "eval")), summary.stages
    exported = json.loads((config.export_dir / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # of 4 layers: low, middle, high
    acceptance = engine.stage_results["eval"].acceptance_length
    print(f"DeepSeek-V3 tiny target: acceptance length {acceptance:.2f} after 40 steps")
    assert acceptance >= 1.0


def test_tensorboard_reads_our_event_files(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from eagleops.pipeline.training.tracking import Trackers, crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    trackers = Trackers(tmp_path)
    for step in range(1, 4):
        trackers.log(step, {"step": step, "loss": 1.0 / step, "lr": 3e-4, "acc": [0.5, 0.25], "tokens_per_s": 1000.0 * step})
    trackers.close()
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == {"loss", "lr", "acc/ttt_0", "acc/ttt_1", "tokens_per_s"}
    assert [(e.step, round(e.value, 4)) for e in reader.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]


@pytest.mark.parametrize(("storage", "worst"), [("fp8", 0.08), ("int8", 0.02)])
def test_one_byte_features_take_about_half_the_bytes_and_read_back_close(workdir, tiny_model, tmp_path_factory, storage, worst):
    """fp8: e4m3's 3 mantissa bits; int8: a 1/127 step of each vector's largest value but the
    ones kept apart (one per 64 values here)."""
    from eagleops.pipeline.training.features.reader import FeatureShards

    other = tmp_path_factory.mktemp(storage)
    shutil.copytree(workdir / "data", other / "data")
    shutil.copytree(workdir / "out", other / "out")
    bf16 = _config(workdir, tiny_model)
    fp8 = _config(other, tiny_model, extract={"storage": storage})
    for config in (bf16, fp8):
        _stage(config, "prepare")
        _stage(config, "extract")
    wide, narrow = FeatureShards(bf16.features_dir), FeatureShards(fp8.features_dir)
    assert narrow.index.storage == storage and narrow.index.tokens == wide.index.tokens
    assert narrow.index.stored_bytes < 0.65 * wide.index.stored_bytes  # 1 byte a value, plus a scale per token and layer
    for i in (0, len(wide) // 2, len(wide) - 1):
        exact, approx = wide[i], narrow[i]
        assert torch.equal(exact["input_ids"], approx["input_ids"]) and approx["aux"].dtype == torch.bfloat16
        for key in ("aux", "final"):
            error = (approx[key].float() - exact[key].float()).norm(dim=-1) / exact[key].float().norm(dim=-1)
            assert error.max() < worst, (key, float(error.max()))


def test_int8_keeps_outliers_exact_and_the_rest_fine():
    """A large target's residual stream: a few channels far above the rest. Kept apart, they
    do not set the step of every other value (plain per-token int8 would lose those)."""
    from eagleops.pipeline.training.features.shards import CODECS

    gen = torch.Generator().manual_seed(0)
    states = torch.randn(64, 3, 1024, generator=gen)
    states[:, :, 7] *= 300.0
    states[5, 1, 900] = -2000.0
    states = states.bfloat16()
    codec = CODECS["int8"]
    parts = codec.encode(states)
    assert parts[""].dtype == torch.int8 and parts["_kept_channel"].shape == (64, 3 * 8)
    back = codec.decode(parts, torch.bfloat16).reshape(states.shape)
    assert torch.equal(back[:, :, 7], states[:, :, 7]) and back[5, 1, 900] == states[5, 1, 900]
    ordinary = torch.ones(1024, dtype=torch.bool)
    ordinary[[7, 900]] = False
    error = (back.float() - states.float())[:, :, ordinary].norm() / states.float()[:, :, ordinary].norm()
    assert error < 0.012, float(error)
    assert codec.bytes(7168, 4) / (2 * 4 * 7168) < 0.505


def test_the_gpu_check_runs_here_on_a_cpu_at_tiny_size():
    """bench/gpu_check.py is what a lent GPU runs first: the same code at tiny size, so it cannot rot."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--hidden", "128", "--layers", "4", "--vocab", "4096",
         "--draft-vocab", "512", "--seq", "128", "--tokens", "256", "--steps", "2", "--ttt", "2"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert result.returncode == 0 and "FAILED" not in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert "extract: 256 tokens" in result.stdout and "train: 2 steps" in result.stdout and "gpu_check: done" in result.stdout


@pytest.mark.timeout(900)  # several torchrun jobs: a loaded 2-core machine runs them 4x slower
@pytest.mark.parametrize("drafter", ["eagle3", "mla3.1", "dflash"])  # Llama attention; MLA with EAGLE-3.1's fc_norm units; DFlash's layers
def test_fsdp_two_processes_match_ddp_and_resume_on_the_same_curve(workdir, tiny_model, tmp_path_factory, drafter):
    import signal
    import time

    config = _config(workdir, tiny_model)
    _stage(config, "prepare")
    _stage(config, "extract")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def run_file(folder: Path, parallel: str) -> Path:
        if folder != workdir:
            shutil.copytree(workdir / "out" / "prepared", folder / "out" / "prepared")
            shutil.copytree(workdir / "out" / "features", folder / "out" / "features")
        run = folder / f"run-{parallel}.toml"
        run.write_text(
            f'name = "{parallel}"\noutput_dir = "{folder / "out"}"\n[[endpoints]]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
            f'[[datasets]]\nname = "B1"\npath = "{workdir / "data" / "sharegpt.jsonl"}"\ntoken_budget = 1\n'
            f'[target]\nmodel = "{tiny_model}"\n[train]\ndrafter = "{drafter}"\nparallel = "{parallel}"\nmax_steps = 120\nbatch_size = 2\nttt_length = 3\n'
            "lr = 3e-3\ncheckpoint_every = 40\nlog_every = 40\n"
        )
        return run

    def torchrun(run: Path) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "eagleops",
            "train",
            str(run),
        ]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def curve(folder: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (folder / "out" / "train" / "history.jsonl").read_text().splitlines()]

    def finish(proc: subprocess.Popen) -> None:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]

    folders = {name: tmp_path_factory.mktemp(name) for name in ("fsdp", "ddp", "killed")}
    finish(torchrun(run_file(folders["fsdp"], "fsdp")))
    finish(torchrun(run_file(folders["ddp"], "ddp")))
    killed = torchrun(run_file(folders["killed"], "fsdp"))
    checkpoint = folders["killed"] / "out" / "train" / "checkpoint.pt"
    try:
        while not checkpoint.exists() and killed.poll() is None:
            time.sleep(0.05)
        import psutil

        for proc in [*psutil.Process(killed.pid).children(recursive=True), psutil.Process(killed.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)  # the whole torchrun job (its workers too), between checkpoints
    finally:
        killed.wait()
    state = torch.load(checkpoint, weights_only=False)
    assert 0 < state["step"] < 120, state["step"]
    finish(torchrun(folders["killed"] / "run-fsdp.toml"))
    sharded, replicated, resumed = curve(folders["fsdp"]), curve(folders["ddp"]), curve(folders["killed"])
    assert len(sharded) == len(replicated) == len(resumed) == 120
    assert resumed == pytest.approx(sharded, rel=1e-5, abs=1e-6)  # the same curve after the kill
    # FSDP computes what DDP does; reduce-scatter and all-reduce sum in different orders, and the
    # float differences grow chaotically over a run (one step 3.5% apart by step 120 in one CI run),
    # so the early steps are held close step by step and the later ones on average: a wrong gradient
    # scale or a lost shard moves the mean, rounding noise does not
    drift = max(abs(a - b) / abs(b) for a, b in zip(sharded, replicated))
    assert sharded[:40] == pytest.approx(replicated[:40], rel=5e-3), drift
    late_sharded, late_replicated = sum(sharded[40:]) / 80, sum(replicated[40:]) / 80
    assert late_sharded == pytest.approx(late_replicated, rel=1e-2), (drift, late_sharded, late_replicated)
