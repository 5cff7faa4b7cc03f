"""What SGLang reads from an export, checked against its loaders' source, since SGLang does not
run here (its wheel needs CUDA). Each rule below is transcribed from SGLang 0.5.23 with its file
and lines, independently of the code under test:

- which target layers it captures for ``eagle_config.eagle_aux_hidden_state_layer_ids``, per
  target architecture (``set_eagle3_layers_to_capture``; ``layers_to_capture`` names the layers
  whose *input* is captured: deepseek_v2.py:3194, llama.py:492);
- the parameters its drafter classes build for a config and how ``load_weights`` maps a
  checkpoint's names onto them (llama_eagle3.py for ``LlamaForCausalLMEagle3``,
  kimi_k25_eagle3.py for ``Eagle3DeepseekV2ForCausalLM``).

The real vLLM loads the same exports in tests/e2e/test_vllm_drafters.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from eagleops.pipeline.training.artifacts import CaptureLayout
from eagleops.pipeline.training.modeling.drafter import EXPORTED_PREFIXES, Eagle3Drafter
from eagleops.pipeline.training.modeling.drafter_config import (
    DrafterChoice,
    drafter_config_from_target,
    exported_capture,
    exported_config,
    serving_engines,
    sglang_unservable,
)
from eagleops.pipeline.training.modeling.layers import default_aux_layers
from tests.zoo.build import TARGETS, real_config, text_config_of, tiny_config

# deepseek_v2.py:3458-3473 (DeepseekV2/V3/V32ForCausalLM; Kimi-K2.5's language model is a
# DeepseekV3ForCausalLM, kimi_k25.py:693) and glm4_moe_lite.py:805-820
ONE_BASED_ONLY_FROM_1 = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                         "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM"}  # fmt: skip


def sglang_captured_outputs(architecture: str, num_layers: int, ids: list[int] | None) -> list[int]:
    """The decoder layers whose outputs SGLang's target captures for these config ids."""
    if ids is None:
        capture = [2, num_layers // 2, num_layers - 3]
    elif architecture in ONE_BASED_ONLY_FROM_1:
        capture = [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)
    elif architecture == "GptOssForCausalLM":  # gpt_oss.py:1337-1352
        capture = list(ids) if ids and max(ids) == num_layers else [v + 1 for v in ids]
    else:  # llama.py:929-941, qwen3.py:778-791 and the rest
        capture = [v + 1 for v in ids]
    return [layer - 1 for layer in capture]  # the input of layer i is the output of layer i - 1


def _text_config(config: dict[str, Any]) -> Any:
    """A transformers config of the text model, carrying the wrapper's architecture as the
    pipeline's target config does."""
    from transformers import AutoConfig, DeepseekV3Config

    text = dict(text_config_of(config))
    fields = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "auto_map")}
    built = DeepseekV3Config(**fields) if "kv_lora_rank" in text else AutoConfig.for_model(text["model_type"], **fields)
    built.architectures = config["architectures"]
    return built


def _layer_choices(num_layers: int) -> list[tuple[int, int, int]]:
    return [default_aux_layers(num_layers), (2, num_layers // 2, num_layers - 3), (0, 3, num_layers - 2)]


@pytest.mark.parametrize("target", TARGETS)
def test_sglang_and_vllm_capture_the_layers_the_drafter_was_trained_on(tmp_path, target):
    real = real_config(target)
    text = _text_config(real)
    architecture, num_layers = real["architectures"][0], text.num_hidden_layers
    for layers in _layer_choices(num_layers):
        trained = drafter_config_from_target(text, draft_vocab_size=32, aux_layers=layers)
        payload = exported_config(trained.to_dict(), CaptureLayout(layers, text.hidden_size, "bf16"), "bfloat16")
        # vLLM: the top-level ids, each the layer whose input is captured (gpu_model_runner.py)
        assert [i - 1 for i in payload["eagle_aux_hidden_state_layer_ids"]] == list(layers)
        ids = payload["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if "sglang" in serving_engines(payload):
            assert sglang_captured_outputs(architecture, num_layers, ids) == list(layers), (target, layers, ids)
        else:  # only layer 0 on a DeepSeek-family target cannot be named to SGLang
            assert architecture in ONE_BASED_ONLY_FROM_1 and layers[0] == 0
            assert all(sglang_captured_outputs(architecture, num_layers, ids) != list(layers) for ids in ([0, *ids[1:]], ids))
            assert "SGLang cannot capture layer 0" in (sglang_unservable(payload) or "")
        (tmp_path / "config.json").write_text(json.dumps(payload))
        assert exported_capture(tmp_path / "config.json").aux_layers == layers


# -- the drafter's weights as SGLang's loaders take them -----------------------------------------


def sglang_parameters(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape) SGLang's drafter class builds for this config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    mla = config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    layer = "model.midlayer." if mla else "model.layers.0."
    params = {
        "model.fc.weight": (hidden, target_hidden * num_aux),
        f"{layer}input_layernorm.weight": (hidden,),
        f"{layer}hidden_norm.weight": (hidden,),
        f"{layer}post_attention_layernorm.weight": (hidden,),
        f"{layer}mlp.gate_up_proj.weight": (2 * inter, hidden),
        f"{layer}mlp.down_proj.weight": (hidden, inter),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
        "model.embed_tokens.weight": (config["vocab_size"], hidden),  # set from the target
    }
    if config.get("fc_norm"):  # kimi_k25_eagle3.py:228-241, llama_eagle3.py:184-196
        params |= {f"model.fc_norm.{i}.weight": (target_hidden,) for i in range(num_aux)}
    heads = config["num_attention_heads"]
    if mla:  # kimi_k25_eagle3.py:109-135: one fused down-projection of the 2H input
        assert config["q_lora_rank"] is not None, "Eagle3 MLA layer requires q_lora_rank"  # :114-117
        q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        params |= {
            f"{layer}self_attn.fused_qkv_a_proj_with_mqa.weight": (q_lora + kv_lora + rope, 2 * hidden),
            f"{layer}self_attn.q_a_layernorm.weight": (q_lora,),
            f"{layer}self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            f"{layer}self_attn.kv_a_layernorm.weight": (kv_lora,),
            f"{layer}self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
            f"{layer}self_attn.o_proj.weight": (hidden, heads * v),
        }
    else:  # llama_eagle3.py:62-70: qkv of the 2H input
        head_dim, kv_heads = config.get("head_dim") or hidden // heads, config["num_key_value_heads"]
        params |= {
            f"{layer}self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, 2 * hidden),
            f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
        }
    assert config["num_hidden_layers"] == 1  # kimi_k25_eagle3.py:243-244
    return params


def sglang_load(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """What ``load_weights`` fills (name -> shape, stacked shards concatenated on dim 0) from a
    checkpoint: llama_eagle3.py:337-376 and kimi_k25_eagle3.py:428-500. A name it cannot place
    raises here (SGLang skips it, some with a warning, and serves without it)."""
    params = sglang_parameters(config)
    mla = config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    stacked = [] if mla else [(".qkv_proj", part) for part in (".q_proj", ".k_proj", ".v_proj")]
    stacked += [(".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]
    filled: dict[str, list[int]] = {}
    pending_a: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(("d2t", "t2d")):
            continue
        if mla:
            name = re.sub(r"^layers\.0\.", "midlayer.", name)
            name = name if name.startswith("lm_head.") else f"model.{name}"
        else:
            name = name.replace("midlayer", "layers.0")  # the legacy name map
        for param, part in stacked:
            if part in name:
                name = name.replace(part, param)
                name = name if name in params else f"model.{name}"
                break
        else:
            if mla and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
                pending_a[name] = tensor
                q = name.replace("kv_a_proj_with_mqa", "q_a_proj")
                kv = q.replace("q_a_proj", "kv_a_proj_with_mqa")
                if q in pending_a and kv in pending_a:
                    fused = torch.cat([pending_a.pop(q), pending_a.pop(kv)])
                    name, tensor = q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa"), fused
                else:
                    continue
            elif not mla and name not in params:
                name = f"model.{name}"
        assert name in params, f"SGLang has no parameter for {name}"
        rows = filled.setdefault(name, [0, *tensor.shape[1:]])
        assert list(tensor.shape[1:]) == rows[1:], name
        rows[0] += tensor.shape[0]
    assert not pending_a, f"half of MLA's fused down-projection: {sorted(pending_a)}"
    return {name: tuple(shape) for name, shape in filled.items()}


@pytest.mark.parametrize("kind", ["eagle3", "eagle3.1", "mla", "mla3.1"])
@pytest.mark.parametrize("target", ["deepseek-v3.1", "kimi-k2.5", "llama-3.1-8b-instruct"])
def test_sglang_loads_every_exported_tensor_into_a_parameter_of_its_shape(target, kind):
    text = _text_config(tiny_config(target))
    layers = default_aux_layers(text.num_hidden_layers)
    trained = drafter_config_from_target(text, draft_vocab_size=48, aux_layers=layers, choice=DrafterChoice(kind))
    drafter = Eagle3Drafter(trained)
    weights = {k: v for k, v in drafter.state_dict().items() if k.startswith(EXPORTED_PREFIXES) and not k.startswith("rotary")}
    config = exported_config(trained.to_dict(), CaptureLayout(layers, text.hidden_size, "bf16"), "bfloat16")
    assert config["architectures"] == (["Eagle3DeepseekV2ForCausalLM"] if kind.startswith("mla") else ["LlamaForCausalLMEagle3"])
    wanted = sglang_parameters(config)
    loaded = sglang_load(config, weights)
    # every parameter filled at its shape, but the embeddings SGLang takes from the target
    assert loaded == {name: shape for name, shape in wanted.items() if name != "model.embed_tokens.weight"}
    assert bool(config.get("norm_output")) is kind.endswith("3.1")  # read as such: kimi_k25_eagle3.py:255, llama_eagle3.py:207
