"""The typed hand-offs between stages carry a schema version: a record from before versions
reads as version 1, one a newer eagleops wrote is refused by name, never read as ours nor
overwritten. Every file of a run is named by the run layout alone."""

from __future__ import annotations

import json

import pytest

from eagleops.pipeline.layout import RunLayout
from eagleops.pipeline.training.artifacts import FeaturesIndex, NewerSchema, PreparedIndex


def _prepared(**extra) -> dict:
    return {"fingerprint": "f", "samples": 1, "tokens": 2, "assistant_tokens": 1, "duplicates_dropped": 0, "truncated": 0,
            "held_out": 0, "max_length": 8, "vocab_size": 10, "draft_vocab_size": 4, "draft_vocab_coverage": 1.0,
            "tokenizer": "t", "shards": [{"file": "shard-0.safetensors", "samples": 1, "tokens": 2}], **extra}  # fmt: skip


def test_an_index_says_its_schema_and_one_from_before_versions_still_reads(tmp_path):
    index = PreparedIndex.from_json(_prepared())
    assert index.to_json()["schema"] == PreparedIndex.SCHEMA
    index.write(tmp_path)
    assert PreparedIndex.read(tmp_path) == index


@pytest.mark.parametrize("kind", ["prepared", "features"])
def test_an_index_a_newer_eagleops_wrote_is_refused_not_prepared_again(tmp_path, kind):
    if kind == "prepared":
        (tmp_path / "index.json").write_text(json.dumps(_prepared(schema=PreparedIndex.SCHEMA + 1)))
        read = PreparedIndex.read_if_present
    else:
        payload = FeaturesIndex("f", [1, 2, 3], 8, 4, "t").to_json()
        (tmp_path / "index.json").write_text(json.dumps({**payload, "schema": FeaturesIndex.SCHEMA + 1}))
        read = FeaturesIndex.read_if_present
    with pytest.raises(NewerSchema, match=r"index\.json: schema \d+, written by a newer eagleops"):
        read(tmp_path)


def test_the_run_layout_names_each_file_once(tmp_path):
    layout = RunLayout(tmp_path)
    files = [layout.lock, layout.engine_log, layout.target_profile, layout.server_log("vllm-generate"), layout.dataset("B1").data,
             layout.dataset("B1").failed, layout.dataset("B1").manifest, layout.prepared_index, layout.draft_vocab, layout.held_out,
             layout.features_index, layout.checkpoint, layout.history, layout.exported_config, layout.exported_weights,
             layout.speculators, layout.eval_result, layout.eval_benchmarks]  # fmt: skip
    assert len(set(files)) == len(files) and all(f.is_relative_to(tmp_path) for f in files)
