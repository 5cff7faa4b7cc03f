"""The capture layout has one home (the features index extract writes) and every stage that
reads a second record of it (the checkpoint, the export) checks that the two agree; the engines'
layer numbering lives in one module."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.training.artifacts import CaptureLayout, CaptureMismatch, Checkpoint, FeaturesIndex
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.modeling.layers import default_aux_layers, engine_layer_ids, layers_from_engine_ids
from tests.conftest import ml_config
from tests.conftest import run_stage as _stage


def test_default_layers_and_each_engines_numbering():
    assert default_aux_layers(8) == (1, 3, 4)  # [1, N//2 - 1, N - 4]
    assert default_aux_layers(61) == (1, 29, 57)
    assert default_aux_layers(4) == (1, 2, 3)  # too shallow for the rule: spread
    layers = (1, 3, 4)
    assert engine_layer_ids(layers, "hf") == [2, 4, 5]  # hidden_states[0] is the embeddings
    assert engine_layer_ids(layers, "sglang") == [1, 3, 4]  # SGLang adds the 1 itself
    assert engine_layer_ids(layers, "vllm") == [2, 4, 5]  # vLLM names the layer whose input it takes
    for engine in ("hf", "sglang", "vllm"):
        assert layers_from_engine_ids(engine_layer_ids(layers, engine), engine) == layers


def test_the_exported_config_names_the_layers_in_both_engines_keys_and_reads_back(tmp_path):
    from transformers import LlamaConfig

    from eagleops.pipeline.training.modeling.drafter_config import (
        ARCHITECTURE,
        drafter_config_from_target,
        exported_capture,
        exported_config,
    )

    target = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4)
    trained = drafter_config_from_target(target, draft_vocab_size=32, aux_layers=(1, 3, 4))
    assert trained.architectures == [ARCHITECTURE] and trained.target_hidden_size == 64
    # until export the drafter spec is in our own terms: its kind and our layer numbering, no engine's ids
    assert trained.drafter == "eagle3" and trained.aux_layers == [1, 3, 4]
    assert not {"eagle_config", "eagle_aux_hidden_state_layer_ids"} & set(trained.to_dict())
    payload = exported_config(trained.to_dict(), CaptureLayout((1, 3, 4), 64, "bf16"), "bfloat16")
    assert payload["architectures"] == [ARCHITECTURE] and payload["draft_vocab_size"] == 32
    assert payload["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert payload["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "aux_layers" not in payload  # one numbering in the exported file: the engines'
    (tmp_path / "config.json").write_text(json.dumps(payload))
    assert exported_capture(tmp_path / "config.json") == CaptureLayout((1, 3, 4), 64)


def test_a_checkpoint_from_before_the_layout_had_a_type_still_loads(tmp_path):
    path = tmp_path / "checkpoint.pt"
    legacy = {"drafter": {}, "optimizer": {}, "scheduler": {}, "step": 3, "history": [], "aux_layers": [1, 3, 4]}
    torch.save({**legacy, "drafter_config": {"target_hidden_size": 64}, "global_batch": 8}, path)
    state = Checkpoint.load(path)
    assert state.capture == CaptureLayout((1, 3, 4), 64) and state.step == 3
    state.save(path)
    assert Checkpoint.load(path).capture == CaptureLayout((1, 3, 4), 64)


def _run_file(tmp_path):
    (tmp_path / "data.jsonl").write_text("")
    return parse_run(
        {
            "output_dir": str(tmp_path / "out"),
            "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
            "datasets": [{"name": "A", "path": "data.jsonl", "token_budget": 1}],
            "target": {"model": str(tmp_path / "no-model-needed")},
        },
        base_dir=tmp_path,
    )


def _features(config, layers: list[int]) -> None:
    config.features_dir.mkdir(parents=True, exist_ok=True)
    FeaturesIndex("prep", layers, 64, 8, "m", samples=0, shard_samples=64, complete=True).write(config.features_dir)


def _mismatch(*files_and_layers) -> str:
    """A CaptureMismatch's message must name both records and both sets of layers."""
    return ".*".join(re.escape(str(part)) for part in files_and_layers)


def test_export_and_eval_refuse_a_drafter_trained_on_other_layers_than_the_features(tmp_path):
    from eagleops.pipeline.training.eval.stage import evaluate
    from eagleops.pipeline.training.export.stage import export
    from eagleops.pipeline.training.modeling.drafter_config import exported_config
    from eagleops.pipeline.training.train.checkpoints import checkpoint_to_resume

    config = _run_file(tmp_path)
    config.train_dir.mkdir(parents=True)
    checkpoint = config.train_dir / "checkpoint.pt"
    trained_on = CaptureLayout((1, 3, 4), 64, "bf16")
    Checkpoint({}, {}, {}, 5, [], trained_on, {"target_hidden_size": 64}).save(checkpoint)
    config.export_dir.mkdir(parents=True)
    drafter_config = {"hidden_size": 64, "num_attention_heads": 4, "draft_vocab_size": 32, "target_hidden_size": 64}
    (config.export_dir / "config.json").write_text(json.dumps(exported_config(drafter_config, trained_on, "bfloat16")))
    _features(config, [0, 2, 5])  # extracted again, other layers
    index = config.features_dir / "index.json"

    with pytest.raises(CaptureMismatch, match=_mismatch(checkpoint, [1, 3, 4], index, [0, 2, 5])):
        export(config, StageContext("export"))
    with pytest.raises(CaptureMismatch, match=_mismatch(config.export_dir / "config.json", [1, 3, 4], index, [0, 2, 5])):
        evaluate(config, StageContext("eval"))
    with pytest.raises(CaptureMismatch, match=_mismatch(checkpoint, [1, 3, 4], index, [0, 2, 5])):
        checkpoint_to_resume(checkpoint, "cpu", FeaturesIndex.read(config.features_dir).capture, config.features_dir)
    _features(config, [1, 3, 4])  # the layers it was trained on: no complaint
    assert checkpoint_to_resume(checkpoint, "cpu", FeaturesIndex.read(config.features_dir).capture, config.features_dir) is not None


def test_re_extracting_other_layers_under_a_trained_drafter_is_an_error_not_a_silent_mismatch(workdir, tiny_model):
    from eagleops.pipeline.training.eval.stage import evaluate

    first = ml_config(workdir, tiny_model, train={"max_steps": 4, "checkpoint_every": 4})
    for stage in ("prepare", "extract", "train", "export"):
        _stage(first, stage)
    exported = json.loads((first.export_dir / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]

    other = ml_config(workdir, tiny_model, train={"max_steps": 8, "checkpoint_every": 4}, extract={"aux_layers": [0, 2, 5]})
    assert _stage(other, "extract").aux_layers == [0, 2, 5]
    index = other.features_dir / "index.json"
    with pytest.raises(CaptureMismatch, match=_mismatch(other.export_dir / "config.json", [1, 3, 4], index, [0, 2, 5])):
        evaluate(other, StageContext("eval"))
    with pytest.raises(CaptureMismatch, match=_mismatch(other.train_dir / "checkpoint.pt", [1, 3, 4], index, [0, 2, 5])):
        _stage(other, "export")
    with pytest.raises(CaptureMismatch, match="delete checkpoint.pt to train afresh"):
        _stage(other, "train")  # it would resume the old drafter on the new layers
