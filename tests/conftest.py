from __future__ import annotations

import asyncio
import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.demo.demo import write_demo_datasets
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.servers.launch import start_server
from eagleops.pipeline.training.context import StageContext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class Server:
    def __init__(self, port: int):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/admin/stats", timeout=5) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/admin/reset", data=b"{}", method="POST")
        urllib.request.urlopen(req, timeout=5).close()


@pytest.fixture(autouse=True)
def _unicode_console(monkeypatch):
    """Consoles under test draw Unicode whatever this machine's TERM and locale; the terminal
    matrix test sets its own."""
    monkeypatch.setenv("EAGLEOPS_ASCII", "0")


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    """Each test's control sockets live in its own folder, so tests never see each other."""
    folder = Path("/tmp") / f"eo-test-{os.getpid()}-{abs(hash(tmp_path.name)) % 10**8}"
    monkeypatch.setenv("EAGLEOPS_RUNTIME_DIR", str(folder))
    yield
    if folder.exists():
        for p in folder.iterdir():
            p.unlink(missing_ok=True)
        folder.rmdir()


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fault")
    with start_server(
        ["eagleops.pipeline.testservers.fault", "--tokens", "20", "--retry-after", "0.1"], folder / "port", log_path=folder / "log"
    ) as port:
        yield Server(port)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS
    from eagleops.pipeline.demo.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", pretrain_steps=TINY_PRETRAIN_STEPS)


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def make_config(tmp_path: Path, base_url: str, datasets: list[dict], **top):
    data = {
        "name": top.pop("name", "t"),
        "output_dir": str(tmp_path / "out"),
        "concurrency": top.pop("concurrency", 8),
        "flush_interval_s": top.pop("flush_interval_s", 0.05),
        "sampling": top.pop("sampling", {"max_tokens": 64}),
        "retry": top.pop("retry", {"base_delay_s": 0.01, "max_delay_s": 0.2, "max_attempts": 4, "timeout_s": 30}),
        "endpoints": top.pop("endpoints", [{"base_url": base_url, "model": "m"}]),
        "datasets": datasets,
        **top,
    }
    return parse_run(data, origin=str(tmp_path / "run.toml"), base_dir=tmp_path)


async def engine_ticks(engine, n: int = 3, timeout: float = 30.0) -> None:
    """Wait for ``n`` more rounds of the engine's periodic progress reports: a quiet spell
    measured in the engine's own ticks (it had ``n`` chances to move), not in a sleep."""
    from eagleops.pipeline.protocol.events import DatasetProgress

    subscription = engine.subscribe()
    seen, wanted = 0, n * max(1, len(engine.generate.runners))
    try:
        async with asyncio.timeout(timeout):
            async for event in subscription:
                seen += isinstance(event, DatasetProgress)
                if seen > wanted:  # the snapshot's own reports come first: they do not count
                    return
    finally:
        subscription.close()


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


class KillAt(StageContext):
    """Kills its stage at the n-th checkpoint, as `eagleops kill STAGE` would."""

    def __init__(self, stage: str, n: int):
        super().__init__(stage)
        self.left = n

    def checkpoint(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.kill()
        super().checkpoint()


# ---- the ML stages' shared setting: a real generate run of the tiny target --------------------------


def ml_config(folder: Path, model: Path, **sections) -> object:
    data = {
        "name": "ml",
        "output_dir": str(folder / "out"),
        "concurrency": 16,
        "sampling": {"max_tokens": 48, "temperature": 1.0},
        "endpoints": [{"base_url": sections.pop("base_url", "http://127.0.0.1:9/v1"), "model": "tiny"}],
        "datasets": [
            {"name": "B1", "path": str(folder / "data" / "sharegpt.jsonl"), "format": "conversations", "token_budget": 2500},
            {"name": "B2", "path": str(folder / "data" / "ultrachat.jsonl"), "format": "messages", "token_budget": 2000},
        ],
        "target": {"model": str(model)},
        "prepare": {"draft_vocab_size": 256, "eval_fraction": 0.1, "eval_max": 16},
        "extract": {"shard_samples": 64, "batch_tokens": 2048},
        "train": {"epochs": 2, "lr": 3e-3, "batch_size": 4, "ttt_length": 4, "warmup_ratio": 0.05, "checkpoint_every": 50, "log_every": 10},
        "eval": {"prompts": 16, "max_new_tokens": 48, "draft_tokens": 4},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_run(data, origin=str(folder / "run.toml"), base_dir=folder)


@pytest.fixture(scope="session")
def generated(tmp_path_factory, tiny_model) -> Path:
    """A real generate run: our model server on loopback serving the tiny target."""
    folder = tmp_path_factory.mktemp("generated")
    write_demo_datasets(folder / "data", count=220)
    with start_server(
        ["eagleops.pipeline.demo.model_server", "--model", str(tiny_model), "--max-batch", "32"], folder / "port", log_path=folder / "log"
    ) as port:
        config = ml_config(folder, tiny_model, base_url=f"http://127.0.0.1:{port}/v1", stages=["generate"])
        summary = asyncio.run(Engine(config).run())
    assert summary.ok
    return folder


@pytest.fixture
def workdir(tmp_path, generated) -> Path:
    shutil.copytree(generated / "data", tmp_path / "data")
    shutil.copytree(generated / "out", tmp_path / "out", ignore=shutil.ignore_patterns(".lock"))
    return tmp_path


def run_stage(config, name: str, ctx: StageContext | None = None):
    from eagleops.pipeline.training.stages import stage_function

    return stage_function(name)(config, ctx or StageContext(name))


@pytest.fixture(scope="session")
def zoo_files(tmp_path_factory):
    """zoo_files("qwen3-8b") -> a folder with that real target's config, tokenizer and template
    (no weights); made once a session."""
    from tests.zoo.build import materialize

    made: dict[str, Path] = {}

    def files(target: str) -> Path:
        if target not in made:
            made[target] = materialize(target, tmp_path_factory.mktemp("zoo-files") / target)
        return made[target]

    return files


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory):
    """zoo_model("kimi-k2.5") -> a tiny random checkpoint with that real target's structure
    (tests/zoo/build.py); built once a session, on first use."""
    from tests.zoo.build import build_tiny

    built: dict[str, Path] = {}

    def model(target: str, keep: dict | None = None) -> Path:
        name = target + "".join(f"-{k}{v}" for k, v in sorted((keep or {}).items()))
        if name not in built:
            built[name] = build_tiny(target, tmp_path_factory.mktemp("zoo") / name, keep)
        return built[name]

    return model


def trained_spans(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of ids the loss mask trains."""
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def builder_for(tokenizer, model_dir: Path | None = None, switches: dict | None = None):
    """prepare's SampleBuilder for a tokenizer: each thinking mode with the template's own switch
    (or ``switches``: mode -> chat_template_kwargs), stopping where a server would."""
    from eagleops.pipeline.training.modeling.thinking_switch import learn_thinking_switch
    from eagleops.pipeline.training.modeling.turns import reply_stop_ids, turn_ends
    from eagleops.pipeline.training.prepare.samples import SampleBuilder

    switch = learn_thinking_switch(tokenizer)
    kwargs = {mode: (switch.kwargs(mode) if switch else {}) for mode in ("keep", "drop", "off")}
    kwargs.update(switches or {})
    stops = reply_stop_ids(tokenizer, model_dir) if model_dir else {*turn_ends(tokenizer), tokenizer.eos_token_id}
    return SampleBuilder.learn(tokenizer, kwargs, stops)
