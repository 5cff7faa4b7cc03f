"""SGLang serving the target with our drafter (``--speculative-algorithm EAGLE3``), for eval.

SGLang reports acceptance per request: ``/generate`` with ``input_ids`` answers ``output_ids``
and ``meta_info`` with ``completion_tokens`` and ``spec_verify_ct`` (verify steps), whose ratio
is its acceptance length (bonus token included), as its own benchmarks compute it.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleops.pipeline.servers.supervisor import LOOPBACK, checked_python

__all__ = ["SGLANG_PYTHON_ENV", "SglangLaunch", "generate_ids", "sglang_python"]

SGLANG_PYTHON_ENV = "EAGLEOPS_SGLANG_PYTHON"


def sglang_python(configured: str = "") -> str:
    missing = f"eval backend sglang: set ${SGLANG_PYTHON_ENV} (or [serve] python) to the python of a venv with SGLang"
    return checked_python(os.environ.get(SGLANG_PYTHON_ENV, "") or configured, missing, "eval backend sglang")


@dataclass(frozen=True)
class SglangLaunch:
    python: str
    model: Path
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    draft: Path | None = None  # a drafter export; None serves the target alone
    draft_tokens: int = 4
    block: bool = False  # the drafter is DFlash's: one block of draft_tokens + 1 (the verified token first)
    cpus: frozenset[int] = frozenset()  # the cores it runs on; empty: eagleops' own

    def argv(self, port: int) -> list[str]:
        argv = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model), "--host", LOOPBACK, "--port", str(port)]
        argv += ["--tp-size", str(self.tensor_parallel_size), "--dp-size", str(self.data_parallel_size)]
        if self.draft is not None and self.block:
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(self.draft)]
            argv += ["--speculative-num-draft-tokens", str(self.draft_tokens + 1)]
        elif self.draft is not None:
            # a chain of draft_tokens drafts (top-1), verified with the bonus token: draft_tokens + 1
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(self.draft)]
            argv += ["--speculative-num-steps", str(self.draft_tokens), "--speculative-eagle-topk", "1"]
            argv += ["--speculative-num-draft-tokens", str(self.draft_tokens + 1)]
        return argv + list(self.extra_args)


def generate_ids(
    base_url: str, prompt: Sequence[int], max_new_tokens: int, *, timeout_s: float = 600.0
) -> tuple[list[int], dict[str, Any]]:
    """Greedy generation from token ids: (output ids, meta_info)."""
    body = {"input_ids": list(prompt), "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    request = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.loads(response.read())
    return list(answer.get("output_ids") or []), dict(answer.get("meta_info") or {})
