"""A vLLM worker extension that captures hidden states for eagleops' extract stage.

It runs inside vLLM's workers (``--worker-extension-cls eagleops_vllm_capture.HiddenStateCapture``),
so it imports nothing of eagleops: the file is copied beside vLLM's log and put on its path.
Its methods are called through ``POST /collective_rpc`` (vLLM's dev-mode endpoint) on every
worker: ``start`` hooks the decoder layers this rank holds (pipeline parallel ranks hold some)
and the final norm, on the first rank of each tensor parallel group only (after each layer's
all-reduce its peers hold the same residual stream: at TP 8, eight copies of every shard); every forward then appends, per hooked
layer, the residual stream after that layer (what HF calls ``hidden_states[L + 1]``) and the
final normed hidden state, and the forward's token ids and positions; ``dump`` writes what was
captured to a safetensors file per rank and clears it. A multimodal model's decoder is its
language model's (vLLM's ``get_language_model()``). What a hook cannot capture (a forward fed
embeddings, not token ids) is raised by the next ``dump``: a worker's exception comes back in
``collective_rpc``'s error body, where one raised in a forward would stop vLLM's engine.

Many prompts are in flight at once, so a forward's rows are the scheduler's batch: each request's
scheduled tokens, contiguous, in the runner's order, a long prompt's chunks in several forwards.
The ids and positions let eagleops give each row back to its prompt (``extract.served``) without
reading the runner's internals, which differ between vLLM's model runners.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

FINAL = "final"
TOKENS = "input_ids"
POSITIONS = "positions"


class HiddenStateCapture:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def eagleops_capture_start(self, layers_json: str) -> str:
        self.eagleops_capture_stop()
        if _tensor_parallel_rank() != 0:  # its peers hold the same residual stream: one dump, not one per rank
            return "[]"
        model: Any = self.get_model()  # type: ignore[attr-defined]
        inner = _decoder(model)
        captured: dict[str, list[torch.Tensor]] = {}
        hooks = []
        for layer in json.loads(layers_json):
            module = inner.layers[layer]
            if type(module).__name__ == "PPMissingLayer":  # held by another pipeline stage
                continue
            captured[str(layer)] = []
            hooks.append(module.register_forward_hook(_keep_residual_stream(captured[str(layer)])))
        if type(inner.norm).__name__ != "PPMissingLayer":
            captured[FINAL] = []
            hooks.append(inner.norm.register_forward_hook(_keep_first(captured[FINAL])))
        captured[TOKENS], captured[POSITIONS] = [], []
        # on the outer model, which the runner calls as a module: the inner one is wrapped by
        # vLLM's compile decorator, which calls its forward directly, past any hook
        faults: list[str] = []
        hooks.append(model.register_forward_pre_hook(_keep_ids(captured[TOKENS], captured[POSITIONS], faults), with_kwargs=True))
        self._eagleops = (captured, hooks, faults)
        return json.dumps(sorted(set(captured) - {TOKENS, POSITIONS}))

    def eagleops_capture_dump(self, path: str) -> str:
        from safetensors.torch import save_file

        captured, _, faults = getattr(self, "_eagleops", ({}, [], []))
        tensors = {} if faults else {name: torch.cat(rows).contiguous() for name, rows in captured.items() if rows}
        for rows in captured.values():
            rows.clear()
        if faults:  # the rows cannot be given back to their prompts: none are written
            fault = faults.pop()
            faults.clear()
            raise RuntimeError(fault)
        rank = int(getattr(self, "rank", 0))
        if tensors:
            save_file(tensors, f"{path}.rank{rank}.safetensors")
        return json.dumps({name: list(t.shape) for name, t in tensors.items()})

    def eagleops_capture_stop(self) -> str:
        _, hooks, _ = getattr(self, "_eagleops", ({}, [], []))
        for hook in hooks:
            hook.remove()
        self._eagleops = ({}, [], [])
        return "stopped"


def _decoder(model: Any) -> Any:
    """The decoder stack (``layers``, final ``norm``) of the model vLLM runs: its language model's
    ``model``, the language model being what the model itself names (vLLM's multimodal
    interface, ``get_language_model()``: Kimi-K2.5's ``language_model``), else the model. Every
    vLLM ``...ForCausalLM`` keeps its decoder in ``model``."""
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model
    return language_model.model


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError):  # no tensor parallel group: the one rank
        return 0


def _keep_residual_stream(rows: list[torch.Tensor]) -> Any:
    def hook(module: Any, inputs: Any, output: Any) -> None:
        # a vLLM decoder layer returns (hidden, residual); the next layer's fused add-norm
        # updates both in place, so the sum is taken now
        if isinstance(output, tuple):
            hidden, residual = output[0], output[1]
            value = hidden if residual is None else hidden + residual
        else:
            value = output
        rows.append(value.detach().to("cpu", torch.bfloat16, copy=True))

    return hook


# Every capture is a copy (``copy=True``): on a CPU worker ``.to("cpu")`` of a tensor already of
# that dtype is the tensor itself, and vLLM refills its input buffers (positions) in place for
# the next forward.


FED_EMBEDDINGS = (
    "vLLM fed {model} embeddings (input_ids=None), not token ids, so eagleops cannot give the captured rows back to "
    "their prompts: vLLM does so for a multimodal model unless it is served with --language-model-only"
)


def _keep_ids(tokens: list[torch.Tensor], positions: list[torch.Tensor], faults: list[str]) -> Any:
    def hook(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        where = kwargs["positions"] if "positions" in kwargs else args[1]
        if ids is None:
            # said at the next dump, through collective_rpc: raised here, it would kill vLLM's
            # engine and the request would end in a bare "EngineCore encountered an issue"
            if not faults:
                faults.append(FED_EMBEDDINGS.format(model=type(module).__name__))
            return
        tokens.append(ids.detach().to("cpu", torch.int64, copy=True).reshape(-1))
        positions.append(where.detach().to("cpu", torch.int64, copy=True).reshape(-1, ids.numel())[-1])  # M-RoPE: [3, N]

    return hook


def _keep_first(rows: list[torch.Tensor]) -> Any:
    def hook(module: Any, inputs: Any, output: Any) -> None:
        value = output[0] if isinstance(output, tuple) else output
        rows.append(value.detach().to("cpu", torch.bfloat16, copy=True))

    return hook


def read_dump(path: str | Path) -> dict[str, torch.Tensor]:
    """Every rank's dump of ``path``, merged (pipeline stages hold different layers)."""
    from safetensors.torch import load_file

    merged: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).parent.glob(Path(path).name + ".rank*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            merged.setdefault(name, tensor)
        file.unlink()
    return merged
