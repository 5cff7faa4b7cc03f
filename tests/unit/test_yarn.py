"""YaRN at export: the drafter's rotary cos/sin tables are the same in training (transformers),
in vLLM and in SGLang, for the zoo's yarn targets (DeepSeek-V3.1, Kimi-K2.5, gpt-oss-20b); the
export adjusts its rope_scaling where that is exact and refuses, naming the engine, where not."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleops.pipeline.errors import InputError
from eagleops.pipeline.servers.vllm import PYTHON_ENV
from eagleops.pipeline.training.artifacts import CaptureLayout
from eagleops.pipeline.training.modeling.drafter_config import drafter_config_from_target, exported_config
from eagleops.pipeline.training.modeling.rope import (
    attention_factor,
    engine_rope_mismatches,
    engine_rope_scaling,
    legacy_engine_warning,
    rope_table,
)
from tests.zoo.build import materialize

# target -> (the cos/sin scale training uses, the scale of releases that drop the mscale keys)
YARN_TARGETS = {"deepseek-v3.1": (1.0, 1.368888), "kimi-k2.5": (1.0, 1.415888), "gpt-oss-20b": (1.346574, 1.346574)}
# both sides of original_max_position_embeddings (4096), and far into the extended context
POSITIONS = [0, 1, 7, 4095, 4096, 30000, 131071]
VLLM_PYTHON = os.environ.get(PYTHON_ENV) or str(Path.home() / ".cache/eagleops/vllm-venv/bin/python")


def _trained_config(target: str, tmp_path: Path) -> Any:
    """The LlamaConfig training builds for the zoo target's real config."""
    from transformers import AutoConfig

    folder = materialize(target, tmp_path / target)
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=target == "kimi-k2.5")
    return drafter_config_from_target(config, draft_vocab_size=32, aux_layers=(1, 3, 4), vocab_size=300)


def _export(trained: Any) -> dict[str, Any]:
    return exported_config(trained.to_dict(), CaptureLayout((1, 3, 4), trained.hidden_size, "bf16"), "bfloat16")


def _transformers_table(trained: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the drafter computes them in training (``Eagle3Drafter.rotary``)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(trained)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.tensor([POSITIONS]))
    return cos[0], sin[0]


@pytest.mark.parametrize("target", sorted(YARN_TARGETS))
def test_each_engines_tables_from_the_export_are_trainings_for_every_zoo_yarn_target(target, tmp_path):
    trained = _trained_config(target, tmp_path)
    scale, legacy_scale = YARN_TARGETS[target]
    hf_cos, hf_sin = _transformers_table(trained)
    assert hf_cos[0, 0].item() == pytest.approx(scale, rel=1e-6)  # cos(0) = the scale itself
    exported = _export(trained)
    assert exported["rope_scaling"]["factor"] == trained.rope_parameters["factor"]
    assert exported["rope_parameters"] == {**exported["rope_scaling"], "rope_theta": exported["rope_theta"]}
    for engine in ("transformers", "vllm", "sglang"):
        assert attention_factor(engine, exported["rope_scaling"]) == pytest.approx(scale, rel=1e-6), engine
        cos, sin = rope_table(engine, exported["rope_scaling"], exported["rope_theta"], trained.head_dim, torch.tensor(POSITIONS))
        torch.testing.assert_close(cos, hf_cos, atol=2e-5, rtol=0, msg=f"{engine} cos")
        torch.testing.assert_close(sin, hf_sin, atol=2e-5, rtol=0, msg=f"{engine} sin")
    assert engine_rope_mismatches(exported["rope_scaling"]) == []
    warning = legacy_engine_warning(exported["rope_scaling"])
    if legacy_scale == scale:
        assert warning is None
    else:
        assert warning is not None and f"would serve {legacy_scale:.6g}" in warning and "vLLM >= 0.32" in warning


def test_an_attention_factor_sglang_ignores_is_exported_as_the_mscale_pair_that_yields_it():
    trained = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "attention_factor": 1.2}
    (message,) = engine_rope_mismatches(trained)
    assert message.startswith("sglang would scale the drafter's rotary cos/sin by 1.36889 where training used 1.2")
    exported = engine_rope_scaling(trained)
    assert exported is not None and exported["mscale_all_dim"] == 1.0 and exported["attention_factor"] == 1.2
    for engine in ("transformers", "vllm", "sglang"):
        assert attention_factor(engine, exported) == pytest.approx(1.2, rel=1e-12), engine


def test_mscale_keys_training_ignores_and_keys_only_sglang_reads_are_dropped():
    # transformers and vLLM read a zero mscale as absent; SGLang would divide by the other one
    trained = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.0, "mscale_all_dim": 1.0}
    assert [m.split(" would")[0] for m in engine_rope_mismatches(trained)] == ["sglang"]
    exported = engine_rope_scaling(trained)
    assert exported is not None and "mscale" not in exported and "mscale_all_dim" not in exported
    assert engine_rope_mismatches(exported, trained) == []
    with_attn = engine_rope_scaling({**trained, "mscale": 1.0, "attn_factor": 2.0})  # SGLang alone multiplies by it
    assert with_attn is not None and "attn_factor" not in with_attn and attention_factor("sglang", with_attn) == 1.0


def test_export_refuses_a_yarn_scale_an_engine_cannot_be_given(tmp_path):
    trained = _trained_config("deepseek-v3.1", tmp_path)
    # no mscale pair can make SGLang's yarn_get_mscale scale a factor of 1 by anything but 1
    trained.rope_parameters = {**trained.rope_parameters, "factor": 1.0, "attention_factor": 0.8}
    with pytest.raises(InputError) as refused:
        _export(trained)
    text = str(refused.value)
    assert "sglang would scale the drafter's rotary cos/sin by 1 where training used 0.8" in text
    assert "Remedy: give the target's yarn rope_scaling as factor > 1 with mscale/mscale_all_dim" in text
    assert "vllm would" not in text  # vLLM reads attention_factor as transformers does
    with pytest.raises(InputError, match="sglang would scale"):  # and before training, not after
        drafter_config_from_target(trained, draft_vocab_size=32, aux_layers=(1, 3, 4))


def test_rope_types_other_than_yarn_are_exported_unchanged():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert engine_rope_scaling(llama3) == llama3 and engine_rope_scaling(None) is None
    assert engine_rope_mismatches(llama3) == [] and legacy_engine_warning(llama3) is None


# vLLM's own code on the config.json our export writes: the path an EAGLE-3 drafter's layer takes
# (get_config, then SpeculativeConfig's EAGLEConfig wrap, then LlamaAttention._init_rotary_emb)
VLLM_TABLES = """
import json, sys
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.transformers_utils.config import get_config
from vllm.transformers_utils.configs.eagle import EAGLEConfig
from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

positions, out = json.loads(sys.argv[1]), {}
for folder in sys.argv[2:]:
    config = get_config(folder, trust_remote_code=False)
    if not isinstance(config, SpeculatorsConfig):
        config = EAGLEConfig(config, method="eagle3", model_type="eagle")
    def rope_for(parameters):
        with set_current_vllm_config(VllmConfig()):
            return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                            rope_parameters=parameters, is_neox_style=True)
    rope = rope_for(config.rope_parameters)
    # what a release that drops the mscale keys reads (vllm-project/vllm#48621)
    dropped = rope_for({k: v for k, v in config.rope_parameters.items() if k not in ("mscale", "mscale_all_dim")})
    out[folder] = {"class": type(rope).__name__, "mscale": rope.mscale, "rows": rope.cos_sin_cache[positions].tolist(),
                   "mscale_without_mscale_keys": dropped.mscale}
print("TABLES " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM: set {PYTHON_ENV} to the python of a venv with vLLM (see .ci/run)")
def test_vllms_own_rotary_code_on_the_exported_config_computes_trainings_tables(tmp_path):
    expected, folders = {}, []
    for target in sorted(YARN_TARGETS):
        trained = _trained_config(target, tmp_path)
        server = _export(trained)
        layout = CaptureLayout((1, 3, 4), trained.hidden_size, "bf16")
        for kind, payload in (("eagle3", server), ("speculators", _speculators(server, layout))):
            folder = tmp_path / "exports" / f"{target}-{kind}"
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(payload))
            folders.append(str(folder))
            expected[str(folder)] = (_transformers_table(trained), YARN_TARGETS[target])
    done = subprocess.run(
        [VLLM_PYTHON, "-c", VLLM_TABLES, json.dumps(POSITIONS), *folders], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("TABLES ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    served = json.loads(lines[-1].removeprefix("TABLES "))
    for folder, ((hf_cos, hf_sin), (scale, legacy_scale)) in expected.items():
        table = served[folder]
        assert table["class"] == "YaRNScalingRotaryEmbedding" and table["mscale"] == pytest.approx(scale, rel=1e-6), folder
        assert table["mscale_without_mscale_keys"] == pytest.approx(legacy_scale, rel=1e-6), folder
        rows, half = torch.tensor(table["rows"]), hf_cos.shape[-1] // 2
        torch.testing.assert_close(rows[:, :half], hf_cos[:, :half], atol=2e-5, rtol=0, msg=f"{folder} cos")
        torch.testing.assert_close(rows[:, half:], hf_sin[:, :half], atol=2e-5, rtol=0, msg=f"{folder} sin")


def _speculators(server: dict[str, Any], layout: CaptureLayout) -> dict[str, Any]:
    """The speculators-format export, the verifier's architectures given (no checkpoint here)."""
    from eagleops.pipeline.training.export.speculators import speculators_config

    return speculators_config(server, layout, Path("/verifier"), ["DeepseekV3ForCausalLM"], 3)
