"""The zoo of real targets (tests/zoo): each artifact loads as the real one would, and each tiny
model keeps its real config's structure and loads with transformers."""

from __future__ import annotations

import json

import pytest

from tests.zoo.build import TARGETS, ZOO, real_config, text_config_of, tiny_config

# (config vocab_size = the head's rows, len(tokenizer)) as in the real files
VOCAB_SIZES = {
    "kimi-k2.5": (163840, 163840),
    "qwen3-8b": (151936, 151669),
    "deepseek-v3.1": (129280, 128815),
    "gpt-oss-20b": (201088, 201088),
    "llama-3.1-8b-instruct": (128256, 128256),
}
REMOTE_CODE = {"kimi-k2.5"}
# where each real checkpoint keeps its head and embeddings
HEAD_AND_EMBEDDINGS = {
    "kimi-k2.5": ("language_model.lm_head.weight", "language_model.model.embed_tokens.weight"),
}
PLAIN_HEAD_AND_EMBEDDINGS = ("lm_head.weight", "model.embed_tokens.weight")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
# two user turns; a tool call with its reasoning, its result, then an answer with reasoning
# (each template reads reasoning under its own key: reasoning_content, reasoning or thinking)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "thinking": "Call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain, 7C"},
    {"role": "assistant", "content": "Rainy, 7C.", "reasoning_content": "Summarise.", "thinking": "Summarise."},
    {"role": "user", "content": "And tomorrow?"},
]


def _tokenizer(folder, target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=target in REMOTE_CODE)


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_has_its_sources_written_down(target):
    source = (ZOO / target / "SOURCE.md").read_text()
    for artifact in (ZOO / target).iterdir():
        if artifact.is_file() and artifact.name != "SOURCE.md":
            assert artifact.name.removesuffix(".xz") in source, f"{target}: {artifact.name} not in SOURCE.md"


@pytest.mark.parametrize("target", TARGETS)
def test_the_real_config_loads_as_transformers_loads_it(target, zoo_files):
    from transformers import AutoConfig

    real = real_config(target)
    try:
        loaded = AutoConfig.from_pretrained(str(zoo_files(target)))
    except ValueError as refused:
        # a transformers without the wrapper's model_type needs its remote code, and says so
        assert target in REMOTE_CODE and "trust_remote_code" in str(refused)
    else:
        text = getattr(loaded, "text_config", None) or loaded
        assert text.vocab_size == text_config_of(real)["vocab_size"]
        assert loaded.architectures == real["architectures"]


def test_kimi_needs_remote_code_for_its_own_classes(zoo_files):
    from transformers import AutoConfig

    folder = zoo_files("kimi-k2.5")
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    assert type(config).__name__ == "KimiK25Config"
    assert config.text_config.vocab_size == 163840
    assert config.auto_map["AutoModelForCausalLM"] == "modeling_kimi_k25.KimiK25ForConditionalGeneration"
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"


@pytest.mark.parametrize("target", TARGETS)
def test_both_vocabulary_sizes_are_the_real_ones(target, zoo_files):
    head_rows, tokenizer_length = VOCAB_SIZES[target]
    assert text_config_of(real_config(target))["vocab_size"] == head_rows
    assert len(_tokenizer(zoo_files(target), target)) == tokenizer_length


# ids the models' own tokenizers give (their published tokenizer.json files)
REFERENCE_IDS = {
    "qwen3-8b": ("Hello world", [9707, 1879]),
    "llama-3.1-8b-instruct": ("Hello world", [9906, 1917]),
    "gpt-oss-20b": ("Hello world", [13225, 2375]),
    "deepseek-v3.1": ("<think>", [128798]),
}


@pytest.mark.parametrize("target", sorted(REFERENCE_IDS))
def test_the_tokenizer_gives_the_real_models_ids(target, zoo_files):
    text, ids = REFERENCE_IDS[target]
    assert _tokenizer(zoo_files(target), target).encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize("target", TARGETS)
def test_the_chat_template_renders_reasoning_and_a_tool_call(target, zoo_files):
    tokenizer = _tokenizer(zoo_files(target), target)
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    for part in ("Weather in Oslo?", "get_weather", "Rainy, 7C.", "And tomorrow?"):
        assert part in text, f"{target}: {part!r} not rendered"
    ids = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert max(ids) < VOCAB_SIZES[target][1]


def test_the_kimi_k2_thinking_template_renders_with_the_kimi_tokenizer(zoo_files):
    tokenizer = _tokenizer(zoo_files("kimi-k2.5"), "kimi-k2.5")
    template = (ZOO / "kimi-k2-thinking" / "chat_template.jinja").read_text()
    text = tokenizer.apply_chat_template(CONVERSATION[:5], tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=False)
    # the template renders a conversation's last assistant answer as history, its reasoning
    # dropped (what issue 18's defect 4 is about): the format a trained turn must not take
    assert "<think></think>Rainy, 7C.<|im_end|>" in text
    assert "Summarise." not in text


def test_the_kimi_tokenizer_splits_han_runs_as_kimi_does(zoo_files):
    """Kimi's pattern keeps a run of Han characters apart from the space before it; a generic
    byte-level pattern over the same ranks does not, so the ids differ."""
    from tokenizers import Tokenizer

    kimi = _tokenizer(zoo_files("kimi-k2.5"), "kimi-k2.5")
    generic = Tokenizer.from_file(str(zoo_files("qwen3-8b") / "tokenizer.json"))  # the same base ranks
    assert kimi.encode(" 中文", add_special_tokens=False) != generic.encode(" 中文").ids
    assert kimi.decode(kimi.encode(" 中文 and more", add_special_tokens=False)) == " 中文 and more"


@pytest.mark.parametrize("target", TARGETS)
def test_the_tiny_config_keeps_the_real_structure(target):
    real, tiny = real_config(target), tiny_config(target)
    for key in ("architectures", "model_type", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert tiny.get(key) == real.get(key)
    real_text, tiny_text = text_config_of(real), text_config_of(tiny)
    assert set(tiny_text) == set(real_text) - {"quantization_config"}
    for key in ("model_type", "vocab_size", "rope_scaling", "rope_theta", "tie_word_embeddings"):
        assert tiny_text.get(key) == real_text.get(key)
    layers = tiny_text["num_hidden_layers"]
    assert len({1, layers // 2 - 1, layers - 4}) == 3, "EAGLE-3's aux layers must be distinct"


@pytest.mark.parametrize("target", TARGETS)
def test_the_tiny_model_loads_and_gives_logits_over_the_heads_rows(target, zoo_model):
    import torch
    from transformers import AutoModelForCausalLM

    folder = zoo_model(target)
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=target in REMOTE_CODE)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, VOCAB_SIZES[target][0])


@pytest.mark.parametrize("target", TARGETS)
def test_the_tiny_weights_carry_the_real_checkpoints_names(target, zoo_model):
    from safetensors import safe_open

    folder = zoo_model(target)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
    head, embeddings = HEAD_AND_EMBEDDINGS.get(target, PLAIN_HEAD_AND_EMBEDDINGS)
    assert {head, embeddings} <= names
    if target == "deepseek-v3.1":
        assert "model.layers.3.mlp.experts.0.gate_proj.weight" in names  # per-expert, as the real one
    if target == "kimi-k2.5":
        assert all(n.startswith(("language_model.", "mm_projector.", "vision_tower.")) for n in names)
