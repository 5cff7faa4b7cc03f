"""The three drafters of issue 23 (EAGLE-3, EAGLE-3.1, MLA attention, and MLA with 3.1's norms):
each one's shape is chosen for the target's family (from the real configs of the zoo), trains,
resumes, exports under the names and keys vLLM's loaders read (vLLM 0.32's ``llama_eagle3.py``
and ``deepseek_eagle3.py``), and is evaluated offline; the MLA layer computes what transformers'
DeepSeek-V3 attention computes. Served in the real vLLM: tests/e2e/test_vllm_drafters.py."""

from __future__ import annotations

import json

import pytest
import torch

from eagleops.pipeline.errors import ConfigError
from eagleops.pipeline.training.modeling.drafter_config import DrafterChoice, drafter_config_from_target, drafter_kind, serving_engines
from tests.conftest import run_stage
from tests.zoo.build import real_config, text_config_of

from .test_real_targets import STAGE_SETTINGS
from .test_real_targets import _config as zoo_run_config


def _real_text_config(target: str):
    """The real model's text config (full size), as transformers fills its defaults: DeepSeek-V3.1's
    config.json has no v_head_dim, transformers' default (128) is what the model runs with."""
    from transformers import AutoConfig, DeepseekV3Config

    text = dict(text_config_of(real_config(target)))
    if "kv_lora_rank" in text:  # Kimi's text model is DeepSeek-V3's
        text["model_type"] = "deepseek_v3"
        return DeepseekV3Config(**{k: v for k, v in text.items() if k not in ("model_type", "architectures", "auto_map")})
    return AutoConfig.for_model(**text)


def _shape(target: str, kind: str, **sizes):
    return drafter_config_from_target(
        _real_text_config(target), draft_vocab_size=32000, aux_layers=(1, 2, 3), choice=DrafterChoice(kind, **sizes)
    )


@pytest.mark.parametrize("target", ["kimi-k2.5", "deepseek-v3.1"])
def test_on_mla_targets_llama_attention_is_specforges_deepseek_shape_and_mla_the_targets_latent(target):
    llama = _shape(target, "eagle3")
    assert (llama.num_attention_heads, llama.head_dim, llama.num_key_value_heads) == (56, 128, 8)  # 56 x 128 = 7168
    assert llama.intermediate_size == 18432 and getattr(llama, "kv_lora_rank", None) is None
    mla = _shape(target, "mla")
    assert mla.num_attention_heads == 56 and mla.num_key_value_heads == 56
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (1536, 512, 128, 64, 128)
    assert mla.head_dim == 64  # the rotary width, as DeepSeek's configs have it
    assert mla.rope_parameters["rope_type"] == "yarn"  # the target's yarn: vLLM's MLA reads it as deepseek_yarn
    assert drafter_kind(mla.to_dict()) == "mla" and drafter_kind(_shape(target, "mla3.1").to_dict()) == "mla3.1"


@pytest.mark.parametrize(
    ("target", "heads", "kv_heads", "head_dim"),
    [("llama-3.1-8b-instruct", 32, 8, 128), ("qwen3-8b", 32, 8, 128), ("gpt-oss-20b", 64, 8, 64)],
)
def test_on_gqa_targets_llama_attention_is_the_targets_and_mla_takes_deepseeks_ratios(target, heads, kv_heads, head_dim):
    llama = _shape(target, "eagle3.1")
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (heads, kv_heads, head_dim)
    assert llama.fc_norm and llama.norm_output
    mla = _shape(target, "mla")
    d = head_dim
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (d, d // 2, d)
    assert mla.kv_lora_rank == 4 * d and mla.q_lora_rank == 12 * d
    assert mla.rope_parameters["rope_type"] == "default"  # vLLM's MLA would read llama3/yarn scaling as DeepSeek's


def test_every_size_can_be_chosen_and_a_bad_choice_names_its_setting():
    chosen = _shape("kimi-k2.5", "eagle3", heads=32, kv_heads=4, head_dim=128, intermediate_size=8192)
    assert (chosen.num_attention_heads, chosen.num_key_value_heads, chosen.head_dim, chosen.intermediate_size) == (32, 4, 128, 8192)
    assert _shape("kimi-k2.5", "mla", heads=16, kv_lora_rank=256).kv_lora_rank == 256
    with pytest.raises(ConfigError, match="train.drafter_kv_heads"):
        _shape("llama-3.1-8b-instruct", "eagle3", kv_heads=5)
    with pytest.raises(ConfigError, match="train.drafter_kv_heads"):
        _shape("kimi-k2.5", "mla", kv_heads=8)
    with pytest.raises(ConfigError, match="train.drafter"):
        DrafterChoice("medusa")


@pytest.mark.parametrize("yarn", [False, True])
def test_the_mla_layer_computes_what_transformers_deepseek_v3_attention_computes(yarn):
    """Same weights, same input: our MLA (the drafter's 2H input) against transformers'
    DeepseekV3Attention built 2H wide, its o_proj padded so that its first H outputs are ours.
    Checks the pair-wise RoPE, the latent split and norms, and yarn's softmax scale."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from eagleops.pipeline.training.modeling.blocks import DraftCache
    from eagleops.pipeline.training.modeling.drafter import Eagle3Drafter

    torch.manual_seed(0)
    hidden, heads = 64, 2
    sizes = dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    rope = (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "rope_theta": 10000.0,
        }
        if yarn
        else {"rope_type": "default", "rope_theta": 10000.0}
    )
    target = DeepseekV3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=96, vocab_size=100,
                              max_position_embeddings=4096, rope_parameters=rope, **sizes)  # fmt: skip
    ours = Eagle3Drafter(
        drafter_config_from_target(target, draft_vocab_size=50, aux_layers=(1, 2, 3), choice=DrafterChoice("mla", heads=heads))
    )
    attention = ours.midlayer.self_attn
    wide = DeepseekV3Config(**{**target.to_dict(), "hidden_size": 2 * hidden, "rope_parameters": rope, "_attn_implementation": "eager"})
    theirs = hf.DeepseekV3Attention(wide, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            getattr(theirs, name).weight.copy_(getattr(attention, name).weight)
        theirs.o_proj.weight.zero_()
        theirs.o_proj.weight[:hidden].copy_(attention.o_proj.weight)
    t = 12
    x = torch.randn(1, t, 2 * hidden)
    positions = torch.arange(t)[None]
    cos, sin = ours.rotary(x, positions)
    with torch.no_grad():
        mine = attention(x, cos, sin, DraftCache.empty(), torch.arange(t), None)
        their_cos, their_sin = hf.DeepseekV3RotaryEmbedding(wide)(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        reference, _ = theirs(x, (their_cos, their_sin), attention_mask=mask)
    assert attention.scale == pytest.approx(theirs.scaling)
    torch.testing.assert_close(mine, reference[..., :hidden], rtol=1e-4, atol=1e-5)


KINDS = ("eagle3.1", "mla", "mla3.1")
# vLLM 0.32's names: llama_eagle3.py (midlayer. -> layers.0., q/k/v fused) and deepseek_eagle3.py
# (q_a_proj + kv_a_proj_with_mqa fused), both reading fc_norm.{i} when fc_norm is set
LLAMA_LAYER = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
MLA_LAYER = {"self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
             "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj"}  # fmt: skip
SHARED = {"input_layernorm", "hidden_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def _expected_tensors(kind: str) -> set[str]:
    layer = (MLA_LAYER if kind.startswith("mla") else LLAMA_LAYER) | SHARED
    names = {f"midlayer.{n}.weight" for n in layer} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    return names | ({f"fc_norm.{i}.weight" for i in range(3)} if kind.endswith("3.1") else set())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["llama-3.1-8b-instruct", "deepseek-v3.1"])
def test_each_drafter_trains_resumes_exports_and_evaluates(tmp_path, zoo_model, target, kind):
    from safetensors import safe_open

    from eagleops.pipeline.training.artifacts import Checkpoint

    train = {**STAGE_SETTINGS["train"], "drafter": kind, "checkpoint_every": 3}
    sections = {**STAGE_SETTINGS, "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.2, "eval_max": 2}}
    config = zoo_run_config(tmp_path, zoo_model(target), {**sections, "train": train})
    for stage in ("prepare", "extract", "train"):
        run_stage(config, stage)
    checkpoint = config.train_dir / "checkpoint.pt"
    first = Checkpoint.load(checkpoint).step
    # a second epoch resumes where the first left off; asked for another drafter, it is refused
    more = {**train, "epochs": 2, "max_steps": 0}
    run_stage(zoo_run_config(tmp_path, zoo_model(target), {**sections, "train": more}), "train")
    assert Checkpoint.load(checkpoint).step == 2 * first
    other = zoo_run_config(tmp_path, zoo_model(target), {**sections, "train": {**more, "drafter": "eagle3", "epochs": 3}})
    with pytest.raises(ConfigError, match=r"checkpoint.pt: trained as another drafter"):
        run_stage(other, "train")
    run_stage(config, "export")
    exported = json.loads((config.export_dir / "config.json").read_text())
    with safe_open(str(config.export_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == _expected_tensors(kind)
    assert drafter_kind(exported) == kind
    if kind.startswith("mla"):
        assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["model_type"] == "deepseek_v2"
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            assert isinstance(exported[key], int)
        assert not config.export_dir.with_name(config.export_dir.name + "-speculators").exists()
    else:
        assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
        speculators = json.loads((config.export_dir.with_name(config.export_dir.name + "-speculators") / "config.json").read_text())
        assert speculators["fc_norm"] is True and speculators["norm_output"] is True
    assert exported["fc_norm"] is kind.endswith("3.1") if "fc_norm" in exported else not kind.endswith("3.1")
    assert serving_engines(exported) == ("sglang", "vllm")
    result = run_stage(config, "eval")  # offline: the export loaded back as a server would
    assert result.verify_steps > 0 and result.acceptance_length >= 1.0
