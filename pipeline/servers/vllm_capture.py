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

During generate (``[extract] during_generate``) the same hooks run on a serving vLLM, and rows
are kept per request: ``eagleops_capture_requests`` also wraps the model runner's
``execute_model`` to learn each forward's batch (the scheduler's ``num_scheduled_tokens`` in the
runner's ``input_batch.req_ids`` order: the order vLLM's runners lay a forward's rows out in),
so prefill chunks and decode steps alike are given to their request by vLLM's own bookkeeping,
never guessed from token ids. Only requests whose id carries a capture mark (the client's
``X-Request-Id``) are kept. ``eagleops_capture_take`` writes the rows of finished requests the
client names, checked whole (every position from 0, a recomputed one kept once), to one file,
and forgets them; the rows of a request nobody takes (cancelled, or failed) go a few minutes
after vLLM says it finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

FINAL = "final"
TOKENS = "input_ids"
POSITIONS = "positions"
OFFSETS = "offsets"
OWNER = "owner"  # a kept row's request (request mode)
MARK = re.compile(r"eagleops-[0-9a-f]{24}")  # in the id of a request to capture (its X-Request-Id)
UNTAKEN_S = 300.0  # how long rows of a finished request nobody took are kept


class HiddenStateCapture:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _eagleops_requests: _Requests | None = None  # request mode (during generate)

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
        runner = getattr(self, "model_runner", None)
        if runner is not None and "execute_model" in vars(runner):  # our wrapper: the class's method again
            del runner.execute_model
        self._eagleops_requests = None
        return "stopped"

    def eagleops_capture_requests(self, layers_json: str) -> str:
        """Capture every marked request's rows, prefill and decode, kept per request."""
        layers = self.eagleops_capture_start(layers_json)
        if _tensor_parallel_rank() != 0:
            return layers
        captured, hooks, faults = self._eagleops
        requests = _Requests(captured, faults)
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        execute = type(runner).execute_model.__get__(runner)

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            requests.guarded(requests.scheduled, scheduler_output, runner.input_batch)
            return execute(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model
        done = self.get_model().register_forward_hook(lambda module, args, output: requests.guarded(requests.forward_done))  # type: ignore[attr-defined]
        hooks.append(done)
        self._eagleops_requests = requests
        return layers

    def eagleops_capture_take(self, path: str, take_json: str) -> str:
        """Write the rows of the requests named (``{"take": [[mark, rows], ...], "forget": [mark,
        ...]}``) to ``path`` (``.rank<r>.safetensors``, written whole then renamed into place) and
        forget them; returns, per mark, the rows' token-id digest or why none were written."""
        requests = getattr(self, "_eagleops_requests", None)
        wanted = json.loads(take_json)
        if requests is None:  # not this rank's (tensor parallel peer), or a restarted server
            return json.dumps({"capturing": False, "peer": _tensor_parallel_rank() != 0})
        return json.dumps(requests.take(path, int(getattr(self, "rank", 0)), wanted["take"], wanted.get("forget", [])))


class _Requests:
    """The rows of every marked request. Each forward's rows get their owner (the request, by the
    batch the runner was given: its requests in ``input_batch.req_ids`` order, each with its
    scheduled tokens, padding after) as one tensor, so a forward costs a few tensor operations
    whatever its batch; a take sorts the kept rows by owner and position once for the batch."""

    def __init__(self, captured: dict[str, list[torch.Tensor]], faults: list[str]) -> None:
        self.captured, self.faults = captured, faults
        self.batch: tuple[dict[str, int], Any] | None = None  # the forward to come: (scheduled counts, input batch)
        self.kept: list[dict[str, torch.Tensor]] = []  # forwards' marked rows, with OWNER: a row's request
        self.owners: dict[str, int] = {}  # mark -> its owner number
        self.next_owner = 0
        self.finished: dict[str, float] = {}  # mark -> when vLLM said the request finished
        self.marks: dict[str, str | None] = {}  # vLLM's request id -> our mark (None: not ours)

    def guarded(self, step: Any, *args: Any) -> None:
        """``step`` run in vLLM's engine loop, where an exception would stop the engine and every
        request with it: kept instead, and raised by the next take (the capture's own failure)."""
        try:
            step(*args)
        except Exception as exc:
            if not self.faults:
                self.faults.append(f"the capture failed in vLLM's engine loop: {type(exc).__name__}: {exc}")
            self.batch = None
            for rows in self.captured.values():
                rows.clear()

    def _owner(self, request_id: str) -> int:
        if request_id not in self.marks:
            found = MARK.search(request_id)
            self.marks[request_id] = found.group(0) if found else None
        mark = self.marks[request_id]
        if mark is None:
            return -1
        if mark not in self.owners:
            self.next_owner += 1  # never a number given before: kept rows of a taken request may still carry it
            self.owners[mark] = self.next_owner
        return self.owners[mark]

    @property
    def rows(self) -> dict[str, int]:
        """Rows kept per mark (what nobody has taken yet)."""
        if not self.kept:
            return {}
        owner = torch.cat([part[OWNER] for part in self.kept])
        by_owner = {number: mark for mark, number in self.owners.items()}
        counts = torch.bincount(owner)
        return {by_owner[int(o)]: int(counts[o]) for o in torch.nonzero(counts).flatten()}

    def scheduled(self, scheduler_output: Any, input_batch: Any) -> None:
        now = time.monotonic()
        for request_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            mark = self.marks.pop(request_id, None)
            if mark is not None:
                self.finished[mark] = now
        expired = [mark for mark, when in self.finished.items() if now - when > UNTAKEN_S]
        if expired:
            self._drop(expired)
        # the runner lays the forward's rows out after it updates its persistent batch from this
        # output: the order is read when the forward is done, the counts are this output's
        counts = getattr(scheduler_output, "num_scheduled_tokens", None)
        self.batch = (counts, input_batch) if counts else None

    def forward_done(self) -> None:
        """One forward's marked rows kept with their owners; the forward's lists emptied."""
        batch, self.batch = self.batch, None
        forward = {name: rows[0] if len(rows) == 1 else torch.cat(rows) for name, rows in self.captured.items() if rows}
        for rows in self.captured.values():
            rows.clear()
        if batch is None or TOKENS not in forward:  # a dummy forward (warm-up, profiling): no request's
            return
        counts, input_batch = batch
        ids = list(input_batch.req_ids)
        owner = torch.repeat_interleave(torch.tensor([self._owner(r) for r in ids]), torch.tensor([int(counts.get(r, 0)) for r in ids]))
        ours = owner >= 0  # padding after the batch's rows, and requests nobody marked, are not kept
        if bool(ours.any()):
            part = {name: t[: owner.numel()][ours] for name, t in forward.items()}
            part[OWNER] = owner[ours]
            self.kept.append(part)

    def _drop(self, marks: list[str]) -> None:
        numbers = torch.tensor([self.owners.pop(m) for m in marks if m in self.owners], dtype=torch.int64)
        for mark in marks:
            self.finished.pop(mark, None)
        if numbers.numel() and self.kept:
            merged = {name: torch.cat([part[name] for part in self.kept]) for name in self.kept[0]}
            stay = ~torch.isin(merged[OWNER], numbers)
            self.kept = [{name: t[stay] for name, t in merged.items()}] if bool(stay.any()) else []

    def take(self, path: str, rank: int, take: list[Any], forget: list[str]) -> dict[str, Any]:
        from safetensors.torch import save_file

        self._drop(list(forget))
        written: dict[str, str] = {}
        missing: dict[str, str] = {}
        wanted = {self.owners[mark]: (k, mark, int(n)) for k, (mark, n) in enumerate(take) if mark in self.owners and int(n) > 0}
        for mark, n in take:
            if mark not in self.owners or int(n) <= 0:
                missing[mark] = "no rows captured" if mark not in self.owners else "no rows wanted"
        merged = {name: torch.cat([part[name] for part in self.kept]) for name in self.kept[0]} if self.kept else {}
        chosen: dict[str, torch.Tensor] = {}
        lengths: list[int] = []
        if wanted and merged:
            numbers = torch.tensor(sorted(wanted), dtype=torch.int64)
            mine = torch.isin(merged[OWNER], numbers)
            rows = torch.nonzero(mine).flatten()
            # the take's order, then position; a position computed twice (a preempted request is
            # recomputed) keeps its last computation: the stable sort keeps rows in computed order
            rank_of = torch.full((int(numbers.max()) + 1,), -1, dtype=torch.int64)
            rank_of[numbers] = torch.tensor([wanted[int(o)][0] for o in numbers])
            positions = merged[POSITIONS][rows]
            key = rank_of[merged[OWNER][rows]] * (int(positions.max()) + 2) + positions
            order = torch.sort(key, stable=True).indices
            key, rows = key[order], rows[order]
            last = torch.ones_like(key, dtype=torch.bool)
            last[:-1] = key[1:] != key[:-1]
            key, rows = key[last], rows[last]
            owners, positions = merged[OWNER][rows], merged[POSITIONS][rows]
            need = torch.zeros(int(numbers.max()) + 1, dtype=torch.int64)
            need[numbers] = torch.tensor([wanted[int(o)][2] for o in numbers])
            inside = positions < need[owners]  # a request's first n positions (distinct, from 0: all n, or some missing)
            have = torch.bincount(owners[inside], minlength=need.numel())
            whole = have == need
            keep = inside & whole[owners]
            chosen = {name: t[rows[keep]] for name, t in merged.items() if name not in (POSITIONS, OWNER)}
            start = 0
            for number in sorted(wanted, key=lambda o: wanted[o][0]):  # the take's order: the rows' order
                _, mark, n = wanted[number]
                if not bool(whole[number]):
                    missing[mark] = f"{int(have[number])} of {n} rows captured"
                    continue
                written[mark] = hashlib.blake2b(
                    chosen[TOKENS][start : start + n].to(torch.int32).numpy().tobytes(), digest_size=16
                ).hexdigest()
                lengths.append(n)
                start += n
        self._drop([mark for _, mark, _ in wanted.values()])
        if self.faults:  # said once, by this take; the batches after it are captured again
            fault = self.faults[0]
            self.faults.clear()
            raise RuntimeError(fault)
        if lengths:
            tensors = {name: t.contiguous() for name, t in chosen.items()}
            tensors[TOKENS] = tensors[TOKENS].to(torch.int32)
            tensors[OFFSETS] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
            target = f"{path}.rank{rank}.safetensors"
            save_file(tensors, target + ".tmp")
            os.replace(target + ".tmp", target)
        return {"capturing": True, "rank": rank, "written": written, "missing": missing, "kept": len(self.owners)}


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
