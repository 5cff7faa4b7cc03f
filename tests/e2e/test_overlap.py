"""Train following extract (``train.overlap_extract``) within a disk bound (``extract.max_cache_gb``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagleops.pipeline.engine import Engine
from eagleops.pipeline.errors import ConfigError, RunError
from eagleops.pipeline.protocol.events import LogEvent, StageStatus
from tests.conftest import ml_config, run_stage

ROOT = Path(__file__).resolve().parents[2]
TRAIN = {"epochs": 1, "batch_size": 2, "ttt_length": 3, "lr": 3e-3, "checkpoint_every": 1000, "log_every": 5, "overlap_extract": True}
EXTRACT = {"shard_samples": 12, "batch_tokens": 1024}


class DiskWatch(threading.Thread):
    """Samples the shard bytes on disk (temporaries included) and whether train has deleted any
    while extract was still writing."""

    def __init__(self, features: Path):
        super().__init__(daemon=True)
        self.features, self.peak, self.overlapped = features, 0, False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            on_disk = 0
            for path in self.features.glob("shard-*"):
                try:
                    on_disk += path.stat().st_size
                except FileNotFoundError:
                    continue
            self.peak = max(self.peak, on_disk)
            if (self.features / "consumed.json").exists() and not _index(self.features).get("complete", True):
                self.overlapped = True


def _index(features: Path) -> dict:
    try:
        return json.loads((features / "index.json").read_text())
    except (OSError, ValueError):
        return {}


def _curve(config) -> list[float]:
    return [json.loads(line)["loss"] for line in (config.train_dir / "history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(generated, tiny_model, tmp_path_factory) -> tuple[Path, list[float], int]:
    """(the generated run's folder, the loss curve of extract-all-then-train in the same
    shard-by-shard order, the largest shard's bytes)."""
    folder = tmp_path_factory.mktemp("reference")
    shutil.copytree(generated / "data", folder / "data")
    shutil.copytree(generated / "out", folder / "out", ignore=shutil.ignore_patterns(".lock"))
    config = ml_config(folder, tiny_model, extract=EXTRACT, train=TRAIN)
    run_stage(config, "prepare")
    run_stage(config, "extract")
    largest = max(s["bytes"] for s in _index(config.features_dir)["shards"].values())
    run_stage(config, "train")
    return folder, _curve(config), largest


def _bounded(reference, tiny_model, folder: Path, **train) -> tuple[object, float]:
    shutil.copytree(reference[0] / "data", folder / "data")
    shutil.copytree(reference[0] / "out" / "prepared", folder / "out" / "prepared")
    bound_gb = 3 * reference[2] / 1e9  # three shards of a dozen samples
    extract = {**EXTRACT, "max_cache_gb": bound_gb}
    return ml_config(folder, tiny_model, extract=extract, train={**TRAIN, **train}, stages=["extract", "train"]), bound_gb


def test_train_follows_extract_within_the_cache_bound_on_the_same_curve(reference, tiny_model, tmp_path):
    config, bound_gb = _bounded(reference, tiny_model, tmp_path)
    watch = DiskWatch(config.features_dir)
    watch.start()
    try:
        summary = asyncio.run(Engine(config).run())
    finally:
        watch.done.set()
        watch.join()
    assert summary.stages["extract"] == StageStatus.DONE and summary.stages["train"] == StageStatus.DONE
    assert watch.overlapped, "train deleted no shard while extract was still writing"
    assert 0 < watch.peak <= bound_gb * 1e9, (watch.peak, bound_gb * 1e9)
    assert _curve(config) == pytest.approx(reference[1], rel=1e-4, abs=1e-6)
    consumed = json.loads((config.features_dir / "consumed.json").read_text())
    shards = _index(config.features_dir)["shards"]
    assert consumed["finished_under"] == _index(config.features_dir)["run_token"] and len(consumed["shards"]) >= len(shards) - 1
    assert not any((config.features_dir / name).exists() for name in consumed["shards"])
    assert _index(config.features_dir)["complete"]


def test_a_train_that_ends_early_stops_a_bounded_extract_and_a_longer_one_resumes_both(reference, tiny_model, tmp_path):
    config, _ = _bounded(reference, tiny_model, tmp_path)
    short = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=30))
    engine = Engine(short)
    events = engine.subscribe()
    summary = asyncio.run(engine.run())
    assert summary.stages["extract"] == StageStatus.DONE and summary.stages["train"] == StageStatus.DONE
    logs = [e.message for e in asyncio.run(_drain(events)) if isinstance(e, LogEvent)]
    assert any("train has finished and the cache is full" in m for m in logs), logs
    assert not _index(config.features_dir).get("complete")
    # the same again: the train, finished already, ends at once, perhaps before this extract has
    # said who it is; the extract must still stop, not wait for room that will never come
    summary = asyncio.run(Engine(short).run())
    assert summary.stages["extract"] == StageStatus.DONE and summary.stages["train"] == StageStatus.DONE
    # more steps: the "finished" of the short train must not stop this extract
    summary = asyncio.run(Engine(config).run())
    assert summary.stages["train"] == StageStatus.DONE and _index(config.features_dir)["complete"]
    assert len(_curve(config)) == len(reference[1])


async def _drain(subscription) -> list:
    return [event async for event in subscription]


def _toml(value: object) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _run_file(config, folder: Path) -> Path:
    """The test's config as a run file, for a real `eagleops run` process."""
    lines = [f"name = {_toml(config.name)}", f"output_dir = {_toml(str(config.output_dir))}", f"stages = {_toml(list(config.stages))}"]
    lines += ["[[endpoints]]", 'base_url = "http://127.0.0.1:9/v1"', 'model = "tiny"']
    lines += ["[[datasets]]", 'name = "B1"', f"path = {_toml(str(folder / 'data' / 'sharegpt.jsonl'))}", "token_budget = 1"]
    lines += ["[target]", f"model = {_toml(str(config.target.model))}"]
    for section in ("extract", "train"):
        values = dataclasses.asdict(getattr(config, section))
        lines += [f"[{section}]", *(f"{k} = {_toml(v)}" for k, v in values.items() if v is not None)]
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(900)  # several torchrun jobs: a loaded 2-core machine runs them 4x slower
def test_a_bounded_overlap_killed_9_resumes_on_the_same_curve(reference, tiny_model, tmp_path):
    config, _ = _bounded(reference, tiny_model, tmp_path)
    command = [sys.executable, "-m", "eagleops", "run", str(_run_file(config, tmp_path)), "--no-tui"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for kill_after in (4, 12):  # shards trained on (and deleted) when the whole run is SIGKILLed
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None and len(_consumed(config.features_dir)) < kill_after:
                time.sleep(0.01)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
        assert not _index(config.features_dir).get("complete")
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert _curve(config) == pytest.approx(reference[1], rel=1e-4, abs=1e-6)
    assert _index(config.features_dir)["complete"]


def _consumed(features: Path) -> list[str]:
    try:
        return json.loads((features / "consumed.json").read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return []


def test_a_cache_bound_needs_a_single_epoch_following_train(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="max_cache_gb"):
        ml_config(tmp_path, tiny_model, extract={"max_cache_gb": 1.0}, train={"epochs": 1})
    with pytest.raises(ConfigError, match="max_cache_gb"):
        ml_config(tmp_path, tiny_model, extract={"max_cache_gb": 1.0}, train={"epochs": 2, "overlap_extract": True})
    ml_config(tmp_path, tiny_model, extract={"max_cache_gb": 1.0}, train={"epochs": 1, "overlap_extract": True})


@pytest.mark.timeout(900)  # several torchrun jobs: a loaded 2-core machine runs them 4x slower
def test_a_two_rank_fsdp_train_follows_an_extract_process(reference, tiny_model, tmp_path_factory):
    """The multi-node recipe on one machine: `eagleops extract` in one process, a two-rank gloo
    torchrun FSDP train following it within the bound; the same curve as after a finished extract."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def torchrun_train(run: Path) -> subprocess.Popen:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "eagleops", "train"]
        return subprocess.Popen(
            [*command, str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

    def finish(proc: subprocess.Popen) -> None:
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, out[-4000:]

    after = tmp_path_factory.mktemp("after")
    shutil.copytree(reference[0] / "data", after / "data")
    shutil.copytree(reference[0] / "out" / "prepared", after / "out" / "prepared")
    shutil.copytree(reference[0] / "out" / "features", after / "out" / "features")
    # FSDP: saving is collective there, so every rank must decide alike when a finished shard saves
    finish(torchrun_train(_run_file(ml_config(after, tiny_model, extract=EXTRACT, train={**TRAIN, "parallel": "fsdp"}), after)))

    following = tmp_path_factory.mktemp("following")
    config, bound_gb = _bounded(reference, tiny_model, following, parallel="fsdp")
    run = _run_file(config, following)
    watch = DiskWatch(config.features_dir)
    watch.start()
    try:
        extract = subprocess.Popen(
            [sys.executable, "-m", "eagleops", "extract", str(run), "--no-tui"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        train = torchrun_train(run)
        finish(train)
        finish(extract)
    finally:
        watch.done.set()
        watch.join()
    assert watch.overlapped and 0 < watch.peak <= bound_gb * 1e9, (watch.peak, bound_gb * 1e9)
    assert _curve(config) == pytest.approx(_curve(ml_config(after, tiny_model)), rel=1e-5, abs=1e-6)


def test_a_following_train_takes_no_index_of_other_features(tmp_path):
    from eagleops.pipeline.training.artifacts import FeaturesIndex
    from eagleops.pipeline.training.context import StageKilled
    from eagleops.pipeline.training.features.reader import FeatureShards
    from tests.conftest import KillAt

    old = FeaturesIndex("prep", [1, 2, 3], 64, 6, "m", storage="bf16", samples=10, shard_samples=4)
    old.write(tmp_path)
    with pytest.raises(StageKilled):  # it waits for the index of the fp8 features being made, never takes this one
        FeatureShards(tmp_path, follow=KillAt("train", 3), layout=("prep", (1, 2, 3), "fp8", 4))
    features = FeatureShards(tmp_path, follow=KillAt("train", 3), layout=("prep", (1, 2, 3), "bf16", 4))
    assert len(features) == 10 and features.waiting_for is None
    FeaturesIndex("prep", [1, 2, 3], 64, 6, "m", storage="fp8", samples=10, shard_samples=4).write(tmp_path)
    with pytest.raises(RunError, match="started over"):  # extract began other features under it
        features.wait_for(9)


@pytest.mark.parametrize("storage", ["bf16", "fp8", "int8"])
def test_the_room_made_for_a_shard_holds_it_whatever_its_samples(storage, tmp_path):
    """The bound is made before the shard is computed; the largest shard so far is no bound,
    since the next may hold longer samples (a CI run wrote past the cache that way)."""
    import torch

    from eagleops.pipeline.training.artifacts import FeaturesIndex
    from eagleops.pipeline.training.features.shards import HEADER_BYTES, shard_bytes_bound, write_feature_shard

    index = FeaturesIndex("prep", [1, 40, 77], 7168, 80, "m", storage=storage, samples=3, shard_samples=3)
    lengths = [5, 130, 61]
    chunk = [(torch.arange(n), torch.ones(n, dtype=torch.bool)) for n in lengths]
    offsets = [0, 5, 135, 196]
    aux, final = torch.randn(196, 3 * 7168).bfloat16(), torch.randn(196, 7168).bfloat16()
    write_feature_shard(tmp_path, "shard-00000.safetensors", chunk, offsets, aux, final, 0, index)
    written = (tmp_path / "shard-00000.safetensors").stat().st_size
    bound = shard_bytes_bound(index, sum(lengths), len(lengths))
    assert written <= bound <= written + HEADER_BYTES


def test_a_consumed_shard_holds_room_until_its_file_is_gone(tmp_path):
    """Train records a shard consumed before deleting it: until the file goes, its bytes count."""
    from eagleops.pipeline.training.artifacts import FeatureShard, FeaturesIndex
    from eagleops.pipeline.training.features.cache import ConsumedShards, live_bytes

    index = FeaturesIndex("prep", [1, 2, 3], 64, 6, "m", samples=8, shard_samples=4)
    index.shards = {"shard-00000.safetensors": FeatureShard(0, 4, 40, 1000), "shard-00001.safetensors": FeatureShard(4, 4, 40, 900)}
    for name in index.shards:
        (tmp_path / name).write_bytes(b"x")
    ConsumedShards("prep", ["shard-00000.safetensors"]).write(tmp_path)
    assert live_bytes(tmp_path, index) == 1900
    (tmp_path / "shard-00000.safetensors").unlink()
    assert live_bytes(tmp_path, index) == 900
