"""Batched capture through vLLM: the scheduler's rows given back to their prompts.

The capture server runs without chunked prefill, so vLLM lays a forward's tokens out request after
request, each a whole prompt at positions 0..n-1, in an order of its own. These tests build such
row streams the way a scheduler would (random token budgets and batch sizes, shuffled order,
prompts sharing long prefixes, duplicates, trailing padding) and check every prompt gets exactly
its rows, in order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.training.extract.served import assign_rows


def _schedule(prompts: list[list[int]], rng: random.Random, budget: int, max_seqs: int, pad: int = 0):
    """(tokens, positions, row -> (prompt, position)) as vLLM's scheduler makes them without
    chunked prefill: whole prompts while the forward's token budget lasts."""
    waiting = list(range(len(prompts)))
    rng.shuffle(waiting)
    tokens, positions, truth = [], [], []
    while waiting:
        batch, left = [], budget
        while waiting and len(batch) < max_seqs and len(prompts[waiting[0]]) <= left:
            left -= len(prompts[waiting[0]])
            batch.append(waiting.pop(0))
        rng.shuffle(batch)  # the runner's order is its own
        for k in batch:
            for p, token in enumerate(prompts[k]):
                tokens.append(token)
                positions.append(p)
                truth.append((k, p))
        for _ in range(pad):  # cudagraph-style padding at the end of a forward
            tokens.append(0)
            positions.append(0)
            truth.append(None)
    return np.array(tokens), np.array(positions), truth


@pytest.mark.parametrize("seed", range(6))
def test_every_prompt_gets_its_own_rows_in_order(seed):
    rng = random.Random(seed)
    system = [1] + [rng.randrange(5000) for _ in range(30)]  # a shared system prompt, as real data has
    prompts = [system + [rng.randrange(3) for _ in range(rng.randint(0, 40))] for _ in range(40)]
    prompts += [list(prompts[3]), prompts[7][:35], [5]]  # a duplicate, a prefix of another, one token
    tokens, positions, truth = _schedule(prompts, rng, budget=rng.choice([80, 256, 4096]), max_seqs=rng.choice([2, 8, 64]), pad=seed % 3)
    order = assign_rows(tokens, positions, prompts)
    assert order.shape[0] == sum(map(len, prompts))
    assert len(set(order.tolist())) == order.shape[0]  # no row given twice
    at = 0
    for prompt in prompts:  # each prompt's rows were computed for a prompt with exactly its tokens
        owners = {truth[r][0] for r in order[at : at + len(prompt)]}
        assert len(owners) == 1 and prompts[owners.pop()] == prompt
        assert [truth[r][1] for r in order[at : at + len(prompt)]] == list(range(len(prompt)))
        at += len(prompt)


def test_rows_from_a_chunk_are_refused():
    """A chunk (position > 0 first) means the server chunked a prompt: say so, guess nothing."""
    with pytest.raises(RunError, match="chunked prefill"):
        assign_rows(np.array([1, 2, 3, 4]), np.array([0, 1, 5, 6]), [[1, 2], [3, 4]])


def test_rows_no_prompt_waits_for_are_an_error():
    with pytest.raises(RunError, match="from token 7"):
        assign_rows(np.array([7, 8]), np.array([0, 1]), [[1, 2]])


def test_a_prompt_with_no_rows_says_so():
    with pytest.raises(RunError, match="no rows for 1 prompts"):
        assign_rows(np.array([1, 2]), np.array([0, 1]), [[1, 2], [1, 3]])


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_only_the_first_tensor_parallel_rank_captures_and_dumps(tp_rank, tmp_path, monkeypatch):
    """After each layer's all-reduce every rank of a TP group holds the same residual stream:
    the rank 0 of the group dumps it, the others capture nothing (at TP 8, not 8 copies)."""
    import sys
    import types

    import torch

    from eagleops.pipeline.servers import vllm_capture

    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank  # type: ignore[attr-defined]
    for name, module in {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.parallel_state": parallel_state,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
            self.norm = torch.nn.Identity()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, input_ids, positions):
            return self.model(torch.ones(len(input_ids), 4))

    class Worker(vllm_capture.HiddenStateCapture):
        rank = tp_rank
        model = Outer()

        def get_model(self):
            return self.model

    worker = Worker()
    worker.eagleops_capture_start("[1]")
    worker.model(input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]))
    worker.eagleops_capture_dump(str(tmp_path / "d"))
    dumped = sorted(p.name for p in tmp_path.iterdir())
    assert dumped == (["d.rank0.safetensors"] if tp_rank == 0 else [])
