"""The target learned once: its profile holds what every stage needs (sizes, head rows and
tensors, class names, the thinking switch), is written to the output directory keyed by the
target files' fingerprint, and a whole run reads config.json and the weight index one time."""

from __future__ import annotations

import json
import shutil

import pytest

from eagleops.pipeline.config import TargetConfig
from eagleops.pipeline.training.modeling import profile as profiles
from eagleops.pipeline.training.modeling import target as target_files
from eagleops.pipeline.training.modeling.profile import learn_profile, target_profile
from tests.conftest import ml_config, run_stage

# the real targets' own facts, from their config.json and chat templates (tests/zoo/*/SOURCE.md)
ZOO = {
    "kimi-k2.5": {"architectures": ("KimiK25ForConditionalGeneration",), "multimodal": True, "switch": "thinking"},
    "qwen3-8b": {"architectures": ("Qwen3ForCausalLM",), "multimodal": False, "switch": "enable_thinking"},
    "deepseek-v3.1": {"architectures": ("DeepseekV3ForCausalLM",), "multimodal": False, "switch": "thinking"},
}


@pytest.mark.parametrize("target", sorted(ZOO))
def test_a_real_targets_profile_says_what_its_files_say(target, zoo_model, zoo_files):
    folder = zoo_model(target)
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    profile = learn_profile(TargetConfig(model=folder, trust_remote_code=target == "kimi-k2.5"))  # its tokenizer is its own code
    assert profile.architectures == ZOO[target]["architectures"] == tuple(raw["architectures"])
    assert (profile.num_layers, profile.hidden_size) == (text["num_hidden_layers"], text["hidden_size"])
    assert profile.multimodal is ZOO[target]["multimodal"]
    assert profile.thinking_switch is not None and profile.thinking_switch.key == ZOO[target]["switch"]
    head = target_files.tensor_rows(folder / profile.head.files[profile.head.head_tensor], profile.head.head_tensor)
    assert profile.head_rows == head >= text["vocab_size"] - 1024  # the head's rows, not the tokenizer's length
    assert (
        learn_profile(TargetConfig(model=zoo_files(target), trust_remote_code=target == "kimi-k2.5")).weights is None
    )  # no weights: enough for inspect
    again = type(profile).from_json(json.loads(json.dumps(profile.to_json())))
    assert again == profile


def test_the_profile_is_learned_once_and_learned_again_when_the_target_changes(tmp_path, tiny_model, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = ml_config(tmp_path, model)
    learned = []
    real_learn = profiles._learn
    monkeypatch.setattr(profiles, "_learn", lambda *a: learned.append(a) or real_learn(*a))
    first = target_profile(config)
    assert target_profile(config) is first and len(learned) == 1  # this process: no second read
    assert json.loads(config.layout.target_profile.read_text())["fingerprint"] == first.fingerprint

    profiles._learned.clear()  # another process (a torchrun rank, a later `eagleops train`): the file
    assert target_profile(config) == first and len(learned) == 1

    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "rms_norm_eps": 1e-5}))
    changed = target_profile(config)
    assert changed.fingerprint != first.fingerprint and len(learned) == 2


def test_a_whole_run_reads_the_targets_config_and_weight_index_once(workdir, tiny_model, monkeypatch):
    reads: dict[str, int] = {"config.json": 0, "weight index": 0, "transformers config": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            reads[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(target_files, "raw_config", counted("config.json", target_files.raw_config))
    monkeypatch.setattr(target_files, "weight_map", counted("weight index", target_files.weight_map))
    monkeypatch.setattr(target_files, "load_target_config", counted("transformers config", target_files.load_target_config))
    profiles._learned.clear()
    (workdir / "out" / "target-profile.json").unlink(missing_ok=True)  # generate's, from the shared run: learn it here
    config = ml_config(workdir, tiny_model, train={"epochs": 1, "max_steps": 4}, eval={"prompts": 2, "max_new_tokens": 8})
    for stage in ("prepare", "extract", "train", "export", "eval"):
        run_stage(config, stage)
    assert reads == {"config.json": 1, "weight index": 1, "transformers config": 1}
