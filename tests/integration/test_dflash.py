"""Issue 37's DFlash drafter: its layers as the published recipe picks them, the block objective
computing exactly what the engines' inference computes (KV injection, each block attending to the
context before it and to itself both ways, never another block), anchors drawn among reply
tokens reproducibly, the run file's checks, and a zoo target through train, resume, export (the
names and keys vLLM's ``qwen3_dflash`` and SGLang's ``dflash`` read) and offline eval. Served by
the real vLLM: tests/e2e/test_vllm_drafters.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.errors import ConfigError, InputError
from eagleops.pipeline.training.modeling.drafter_config import DrafterChoice, drafter_config_from_target, drafter_kind, serving_engines
from eagleops.pipeline.training.modeling.layers import dflash_aux_layers
from tests.conftest import run_stage

from .test_drafters import _real_text_config
from .test_real_targets import STAGE_SETTINGS
from .test_real_targets import _config as zoo_run_config

# vLLM 0.32 qwen3_dflash.py load_weights: per layer Qwen3's names (q_norm/k_norm), then fc,
# hidden_norm and norm; no embeddings, no lm_head (both engines share the target's)
LAYER = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"}  # fmt: skip


def _drafter(layers: int = 2, block_size: int = 4, seed: int = 0):
    from transformers import Qwen3Config

    from eagleops.pipeline.training.modeling.dflash import DFlashDrafter

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rope_theta=10000.0)  # fmt: skip
    config.aux_layers, config.target_hidden_size, config.block_size, config.mask_token_id = [1, 2], 32, block_size, 3
    drafter = DFlashDrafter(config)
    drafter.set_target(torch.randn(50, 32), torch.randn(50, 32))
    for p in drafter.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return drafter


def test_layers_are_spread_as_the_published_drafters_pick_them():
    assert dflash_aux_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B DFlash: target_layer_ids [1, 9, 17, 25, 33]
    assert dflash_aux_layers(30, 5) == (1, 8, 14, 20, 27)  # SmolLM2 (SpecForge's rounding: Python's, half to even)
    assert dflash_aux_layers(30, 1) == (15,)
    with pytest.raises(InputError, match="too shallow for 5 distinct dflash layers"):
        dflash_aux_layers(6, 5)


def test_on_real_targets_the_shape_is_qwen3_layers_of_the_targets_width():
    for target, heads, kv_heads in (("qwen3-8b", 32, 8), ("kimi-k2.5", 56, 8)):
        config = drafter_config_from_target(_real_text_config(target), draft_vocab_size=1, aux_layers=(1, 9, 17, 25, 33),
                                            vocab_size=1000, choice=DrafterChoice("dflash", layers=5), mask_token_id=7)  # fmt: skip
        assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (5, heads, kv_heads)
        assert config.architectures == ["DFlashDraftModel"] and drafter_kind(config.to_dict()) == "dflash"


def test_the_training_forward_computes_what_the_engines_inference_computes():
    """Every block of the training forward gives the logits a session (context extended up to its
    verified token, then one block proposed, as vLLM's proposer runs) gives for it."""
    from eagleops.pipeline.training.train.block_loss import BlockObjective

    drafter = _drafter()
    t = 24
    ids, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 64)
    loss_mask = torch.ones(1, t, dtype=torch.long)
    loss_mask[0, :5] = 0  # a prompt: no block starts there
    seen = []
    blocks = drafter.blocks
    drafter.blocks = lambda *a: seen.append((a[1], a[2], blocks(*a))) or seen[-1][2]  # type: ignore[method-assign]
    objective = BlockObjective(drafter, anchors=100, block_decay=7.0, seed=0, rank=0, head_chunk=0)
    batch = {
        "input_ids": ids,
        "aux": aux,
        "final": torch.randn(1, t, 32),
        "loss_mask": loss_mask,
        "lengths": torch.tensor([t]),
        "step": torch.tensor(0),
    }
    objective(batch)
    drafter.blocks = blocks  # type: ignore[method-assign]
    tokens, positions, out = torch.cat([s[0] for s in seen], 1), torch.cat([s[1] for s in seen], 1), torch.cat([s[2] for s in seen], 1)
    starts = positions[0, ::4].tolist()
    assert starts == sorted(starts) and min(starts) >= 5 and len(starts) == t - 5 - 1  # every reply token but the last
    for i, anchor in enumerate(starts):
        assert tokens[0, 4 * i] == ids[0, anchor] and (tokens[0, 4 * i + 1 : 4 * i + 4] == 3).all()
        session = drafter.session()
        session.extend(aux[:, :anchor], [int(ids[0, anchor])])
        expected = out[0, 4 * i + 1 : 4 * i + 4]
        with torch.no_grad():
            got = drafter.blocks(
                list(zip(session.keys, session.values)), tokens[:, 4 * i : 4 * i + 4], positions[:, 4 * i : 4 * i + 4], None
            )
        torch.testing.assert_close(got[0, 1:], expected, rtol=1e-4, atol=1e-5)
        assert session.propose(3) == (expected @ drafter.lm_head.T).argmax(-1).tolist()


def test_anchors_are_reply_tokens_drawn_alike_for_a_step_and_the_loss_weighs_slots_as_the_recipe():
    from eagleops.pipeline.training.train.block_loss import BlockObjective, draw_anchors

    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([12, 4])
    anchors, real = draw_anchors(mask, lengths, 3, torch.Generator().manual_seed(1))
    again, _ = draw_anchors(mask, lengths, 3, torch.Generator().manual_seed(1))
    assert torch.equal(anchors, again) and anchors.shape == (2, 3)
    valid = {0: {2, 3, 6, 7, 8}, 1: {1, 2}}  # token and next token are reply tokens, inside the sample
    for row in range(2):
        chosen = anchors[row][real[row]].tolist()
        assert chosen == sorted(chosen) and set(chosen) <= valid[row] and len(chosen) == min(3, len(valid[row]))
    weights = BlockObjective(_drafter(block_size=5), anchors=4, block_decay=7.0, seed=0, rank=0, head_chunk=0).slot_weights(
        torch.device("cpu")
    )
    assert weights.tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7), math.exp(-3 / 7)])


def test_the_run_file_says_what_each_drafter_reads(tmp_path):
    base = {
        "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
        "datasets": [{"name": "a", "path": "a.jsonl", "token_budget": 1}],
    }

    def parse(**sections):
        return parse_run({**base, **sections}, origin=str(tmp_path / "run.toml"), base_dir=tmp_path)

    with pytest.raises(ConfigError, match="an EAGLE-3 drafter .eagle3. reads three layers"):
        parse(extract={"aux_layers": [1, 2, 3, 4]})
    with pytest.raises(ConfigError, match="eagle3.1 is served with one decoder layer"):
        parse(train={"drafter": "eagle3.1", "drafter_layers": 2})
    with pytest.raises(ConfigError, match="one target layer per drafter layer"):
        parse(train={"drafter": "dflash", "drafter_layers": 2}, extract={"aux_layers": [1, 2, 3]})
    with pytest.raises(ConfigError, match="distinct layer indices in ascending order"):
        parse(train={"drafter": "dflash"}, extract={"aux_layers": [3, 1]})
    assert parse(train={"drafter": "dflash", "drafter_layers": 2}, extract={"aux_layers": [1, 3]}).train.block_size == 16


def test_a_dflash_drafter_trains_resumes_exports_and_evaluates(tmp_path, zoo_model):
    from safetensors import safe_open

    from eagleops.pipeline.training.artifacts import Checkpoint

    target = zoo_model("llama-3.1-8b-instruct")
    train = {**STAGE_SETTINGS["train"], "drafter": "dflash", "drafter_layers": 2, "block_size": 4, "anchors": 16, "checkpoint_every": 3}
    sections = {**STAGE_SETTINGS, "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.2, "eval_max": 2}}
    config = zoo_run_config(tmp_path, target, {**sections, "train": train})
    for stage in ("prepare", "extract", "train"):
        run_stage(config, stage)
    index = json.loads((config.features_dir / "index.json").read_text())
    assert len(index["aux_layers"]) == 2  # one target layer per drafter layer, spread over the target's depth
    checkpoint = config.train_dir / "checkpoint.pt"
    first = Checkpoint.load(checkpoint)
    assert not any(key.startswith(("embed_tokens", "lm_head")) for key in first.drafter)  # the target's, never saved
    more = {**train, "epochs": 2, "max_steps": 0}
    run_stage(zoo_run_config(tmp_path, target, {**sections, "train": more}), "train")
    assert Checkpoint.load(checkpoint).step == 2 * first.step
    other = zoo_run_config(tmp_path, target, {**sections, "train": {**more, "block_size": 8, "epochs": 3}})
    with pytest.raises(ConfigError, match=r"trained as another drafter .*block_size 4 -> 8"):
        run_stage(other, "train")
    eagle = zoo_run_config(tmp_path, target, {**sections, "train": {**more, "drafter": "eagle3", "drafter_layers": 0}})
    with pytest.raises(ConfigError, match=r"the features hold layers \[\d+, \d+\] .*an EAGLE-3 drafter \(eagle3\) reads three"):
        run_stage(eagle, "train")
    run_stage(config, "export")
    exported = json.loads((config.export_dir / "config.json").read_text())
    with safe_open(str(config.export_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {f"layers.{i}.{n}.weight" for i in range(2) for n in LAYER} | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["model_type"] == "qwen3"
    assert exported["dflash_config"]["target_layer_ids"] == index["aux_layers"]  # the output of layer i: our own numbering
    assert exported["dflash_config"]["block_size"] == exported["block_size"] == 4
    assert exported["layer_types"] == ["full_attention"] * 2 and "eagle_config" not in exported  # vLLM's runner would read its ids
    assert 0 <= exported["dflash_config"]["mask_token_id"] < exported["vocab_size"]
    assert drafter_kind(exported) == "dflash" and serving_engines(exported) == ("sglang", "vllm")
    assert not config.export_dir.with_name(config.export_dir.name + "-speculators").exists()
    result = run_stage(config, "eval")  # offline: the export loaded back as a server would, drafting its block
    assert result.draft_tokens == 3 and result.verify_steps > 0 and result.acceptance_length >= 1.0


def test_the_console_shows_a_blocks_positions_within_80_columns():
    from eagleops.console.panes.training import _train_lines
    from eagleops.console.state import ConsoleState

    state = ConsoleState()
    state.stage_metrics["train"] = {"loss": 3.2, "lr": 1e-3, "acc": [0.61, *[0.5] * 14], "block_acceptance": 1.83}
    lines = _train_lines(state, 78, 20, 0.0)  # the training pane's width at 80x24
    assert all(len(line) <= 78 for line in lines)
    assert lines[1].startswith("accuracy by draft position  0.61 0.50") and lines[1].endswith(" ...")
    assert "acceptance per training block 1.83" in lines
