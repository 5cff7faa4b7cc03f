"""Weights & Biases, offline: what a train and the eval after it log is in the run's own file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from eagleops.pipeline.training.tracking import Trackers

_BLOCK = 32768
_HEADER = 7  # ":W&B", a 2-byte magic, a version byte


def read_wandb_file(path: Path) -> list[object]:
    """The records of a ``.wandb`` file: a LevelDB-log stream (32 KiB blocks of checksummed
    chunks, a record split FIRST/MIDDLE/LAST across blocks) of ``Record`` protocol buffers."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history(directory: Path) -> tuple[set[str], dict[str, dict[str, float]]]:
    """(run ids, {step: {key: value}}) over every offline run file under ``directory``."""
    import json

    ids: set[str] = set()
    steps: dict[str, dict[str, float]] = {}
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        for record in read_wandb_file(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                steps.setdefault(str(items.pop("_step")), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return ids, steps


def test_wandb_offline_gets_each_ttt_step_and_one_run_across_resume_and_eval(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the test extra: pip install -e '.[test]'")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    record = {"step": 1, "epoch": 0, "loss": 2.5, "lr": 1e-4, "tokens_per_s": 900.0, "acc": [0.5, 0.25], "step_loss": [1.0, 2.0]}
    first = Trackers(tmp_path, wandb_project="eagleops-test", run_name="demo", config={"lr": 1e-4})
    first.log(1, record)
    first.log(2, {**record, "loss": 2.0})
    first.close()
    resumed = Trackers(tmp_path, wandb_project="eagleops-test", run_name="demo")  # a resumed train, then eval
    resumed.log(3, {**record, "loss": 1.5})
    resumed.log(3, {"eval/acceptance_length": 2.75})
    resumed.close()

    ids, steps = _history(tmp_path)
    assert len(ids) == 1 and ids == {(tmp_path / "wandb-run-id").read_text().strip()}
    assert [steps[s]["loss"] for s in ("1", "2", "3")] == [2.5, 2.0, 1.5]
    assert steps["1"]["acc/ttt_1"] == 0.25 and steps["1"]["step_loss/ttt_0"] == 1.0
    assert steps["1"]["lr"] == 1e-4 and steps["1"]["tokens_per_s"] == 900.0
    assert steps["3"]["eval/acceptance_length"] == 2.75
    assert list((tmp_path / "tensorboard").iterdir())  # TensorBoard gets the same, always
