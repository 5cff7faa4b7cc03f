"""The two ways of the drafter's TTT attention compute the same thing: the fused flex_attention
path (what a GPU trains with) against the eager one, here on a CPU (flex's forward runs there)."""

from __future__ import annotations

import pytest
import torch

from eagleops.pipeline.training.modeling import ttt_attention as attention


@pytest.fixture
def uncompiled_flex(monkeypatch):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(attention, "_compiled", lambda: (flex.flex_attention, flex.create_block_mask))


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_flex_equals_eager_at_every_ttt_step_with_padding(uncompiled_flex, steps):
    torch.manual_seed(0)
    b, heads, t, d = 2, 4, 160, 32  # over one 128-block, so the block mask's skipping is exercised
    keys = [torch.randn(b, heads, t, d) for _ in range(steps)]
    values = [torch.randn(b, heads, t, d) for _ in range(steps)]
    q = torch.randn(b, heads, t, d)
    positions = torch.arange(t)
    padding = positions[None, :] < torch.tensor([t, 97])[:, None]  # the second row padded from 97 on
    eager = attention.ttt_attention(q, keys, values, positions, padding, flex=False)
    fused = attention.ttt_attention(q, keys, values, positions, padding, flex=True)
    valid = padding[:, None, :, None].expand_as(eager)  # padded queries are never trained on
    torch.testing.assert_close(fused[valid], eager[valid], rtol=1e-4, atol=1e-5)


def test_flex_is_chosen_on_cuda_only_and_never_for_one_query():
    assert not attention.flex_available(torch.zeros(1, 8, 4), 3)
    assert not attention.flex_available(torch.zeros(1, 1, 4), 3)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not (ROOT / "bench" / "_work" / "specforge").is_dir(),
    reason="SpecForge's wheel is not unpacked in bench/_work/specforge (bench/gpu_check.sh --fetch-wheels does it)",
)
def test_the_specforge_comparison_runs_at_tiny_size():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "bench/train_vs_specforge.py", "--specforge", "bench/_work/specforge", "--hidden", "64", "--vocab", "2048",
         "--draft-vocab", "512", "--seq", "128", "--steps", "1", "--rounds", "1", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SpecForge 0.2.0" in done.stdout and "ours" in done.stdout
