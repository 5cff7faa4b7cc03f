"""The embedded default: an offline run on a tiny local model, start to finish in well under
three minutes on two CPU cores. Everything it needs is made here, once, and cached in DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagleops.pipeline.demo.tinymodel import build_tiny_model, sample_text
from eagleops.pipeline.servers.launch import start_server

__all__ = ["DemoRun", "RealDemoRun", "prepare_demo", "prepare_real_demo", "write_demo_datasets"]

TINY_PRETRAIN_STEPS = 120  # a real (if tiny) language model: its next token has structure to learn

DATASETS = (
    # name, file, format, token budget
    ("B1", "sharegpt.jsonl", "conversations", 3000),
    ("B2", "ultrachat.jsonl", "messages", 2500),
    ("B3", "prompts.jsonl", "prompt", 2000),
)


def write_demo_datasets(directory: Path, *, count: int = 300, seed: int = 1) -> None:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[Any]] = {
        "sharegpt.jsonl": [
            {
                "id": f"sg-{i}",
                "conversations": [
                    {"from": "human", "value": sample_text(rng, rng.randint(5, 25))},
                    {"from": "gpt", "value": sample_text(rng, 12)},
                ],
            }
            for i in range(count)
        ],
        "ultrachat.jsonl": [
            {
                "id": f"uc-{i}",
                "messages": [
                    {"role": "user", "content": sample_text(rng, rng.randint(5, 20))},
                    {"role": "assistant", "content": sample_text(rng, 10)},
                    {"role": "user", "content": sample_text(rng, rng.randint(3, 12))},
                ],
            }
            for i in range(count)
        ],
        "prompts.jsonl": [{"prompt": sample_text(rng, rng.randint(4, 18))} for _ in range(count)],
    }
    for name, items in rows.items():
        path = directory / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in items))
        os.replace(tmp, path)


@dataclass
class DemoRun:
    directory: Path
    model_dir: Path

    @property
    def run_path(self) -> Path:
        return self.directory / "run.toml"

    def write_run(self, port: int) -> Path:
        lines = [
            'name = "demo"',
            'output_dir = "out"',
            "concurrency = 32",
            "status_interval_s = 3",
            f'tokenizer = "{self.model_dir.name}"',
            "",
            "[sampling]",
            "max_tokens = 96",
            "temperature = 1.0",
            "",
            "[[endpoints]]",
            f'base_url = "http://127.0.0.1:{port}/v1"',
            'model = "tiny-llama"',
        ]
        for name, file, fmt, budget in DATASETS:
            lines += ["", "[[datasets]]", f'name = "{name}"', f'path = "data/{file}"', f'format = "{fmt}"', f"token_budget = {budget}"]
        lines += [
            "",
            "# The ML stages, sized for a tiny target on two CPU cores.",
            "[target]",
            f'model = "{self.model_dir.name}"',
            "[prepare]",
            "draft_vocab_size = 256",
            "[extract]",
            "shard_samples = 128",
            "[train]",
            "epochs = 2",
            "lr = 3e-3",
            "batch_size = 4",
            "ttt_length = 4",
            "warmup_ratio = 0.05",
            "checkpoint_every = 100",
            "[eval]",
            "prompts = 20",
            "max_new_tokens = 64",
            "draft_tokens = 4",
        ]
        self.run_path.write_text("\n".join(lines) + "\n")
        return self.run_path

    served_name: ClassVar[str] = "tiny-llama"
    max_batch: ClassVar[int] = 32

    @contextlib.contextmanager
    def serve(self) -> Iterator[Path]:
        argv = [
            "eagleops.pipeline.demo.model_server",
            "--model",
            str(self.model_dir),
            "--name",
            self.served_name,
            "--max-batch",
            str(self.max_batch),
        ]
        with start_server(argv, self.directory / "server.port", log_path=self.directory / "server.log") as port:
            yield self.write_run(port)


@dataclass
class RealDemoRun(DemoRun):
    """The same pipeline on the real SmolLM2-135M-Instruct and the raw ShareGPT V3 file
    (``pipeline/demo/real.py``), served by our own model server on this machine's CPU."""

    sharegpt: Path = Path()
    served_name: ClassVar[str] = "SmolLM2-135M-Instruct"
    max_batch: ClassVar[int] = 16

    def write_run(self, port: int) -> Path:
        text = f"""# eagleops demo --real: SmolLM2-135M-Instruct answers ShareGPT's questions, then every ML stage
name = "demo-real"
output_dir = "out"
concurrency = 16
status_interval_s = 5

[sampling]
max_tokens = 128
temperature = 0.7
top_p = 0.9

[[endpoints]]
base_url = "http://127.0.0.1:{port}/v1"
model = "{self.served_name}"

[[datasets]]
name = "sharegpt"
path = "{self.sharegpt}"       # the raw V3 file, cut off mid-item as published
format = "sharegpt"
token_budget = 6000
long_prompts = "drop-oldest"  # long chats lose their earliest turns, so the reply is trained

[target]
model = "{self.model_dir}"
[prepare]
max_length = 768
draft_vocab_size = 8192
eval_fraction = 0.1
eval_max = 12
[extract]
shard_samples = 64
[train]
epochs = 3
lr = 2e-3
batch_size = 2
ttt_length = 4
warmup_ratio = 0.05
checkpoint_every = 50
log_every = 5
[eval]
prompts = 12
max_new_tokens = 64
draft_tokens = 3
"""
        self.run_path.write_text(text)
        return self.run_path


def prepare_real_demo(directory: Path, *, fresh: bool = False, log: Callable[[str], None] = lambda m: None) -> RealDemoRun:
    """The real model and data (built or fetched once, into eagleops' cache) and a run on them."""
    from eagleops.pipeline.demo.real import sharegpt_file, smollm2_checkpoint

    directory = directory.resolve()
    if fresh:
        shutil.rmtree(directory / "out", ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_checkpoint(log=log)
    sharegpt = sharegpt_file(log=log)
    log(f"demo files in {directory}; starting SmolLM2 on 127.0.0.1 (our model server, on this CPU) ...")
    return RealDemoRun(directory, model_dir, sharegpt)


def prepare_demo(directory: Path, *, fresh: bool = False, log: Callable[[str], None] = lambda m: None) -> DemoRun:
    directory = directory.resolve()
    if fresh:
        shutil.rmtree(directory / "out", ignore_errors=True)
    model_dir = directory / "tiny-llama"
    if not (model_dir / "eagleops-tiny.json").exists():
        log(f"building the tiny target model and tokenizer in {model_dir} (once) ...")
    build_tiny_model(model_dir, pretrain_steps=TINY_PRETRAIN_STEPS)
    if not (directory / "data" / "prompts.jsonl").exists():
        write_demo_datasets(directory / "data")
    log(f"demo files in {directory}; starting the model server on 127.0.0.1 ...")
    return DemoRun(directory, model_dir)
