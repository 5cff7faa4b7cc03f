"""Real targets from the zoo (tests/zoo) through the stages' target handling (issue 18):
remote code only when opted in and never a substitute tokenizer (1), wrapped language models
found by their config and weight map (2), one vocabulary size, the head's rows (3), and the
speculators export naming the real verifier (10)."""

from __future__ import annotations

import json

import pytest

from eagleops.pipeline.config import TargetConfig, parse_run
from eagleops.pipeline.errors import ConfigError
from tests.conftest import run_stage

CONVERSATIONS = [
    [{"role": "user", "content": f"Question {i} about 中文?"}, {"role": "assistant", "content": f"Answer {i}: 中文 and more text."}]
    for i in range(24)
]
# the ML stages at the zoo's tiny size
STAGE_SETTINGS = {
    "extract": {"shard_samples": 8, "batch_tokens": 512},
    "train": {"epochs": 1, "max_steps": 6, "lr": 3e-3, "batch_size": 4, "ttt_length": 2, "checkpoint_every": 50, "log_every": 2},
    "eval": {"prompts": 2, "max_new_tokens": 8, "draft_tokens": 2},
}


def _config(folder, model, sections=None, **target):
    (folder / "src.jsonl").write_text("\n".join(json.dumps({"conversations": c[:1]}) for c in CONVERSATIONS) + "\n")
    generated = folder / "out" / "D" / "data.jsonl"
    generated.parent.mkdir(parents=True, exist_ok=True)
    generated.write_text("\n".join(json.dumps({"conversations": c}, ensure_ascii=False) for c in CONVERSATIONS) + "\n")
    data = {
        "name": "zoo",
        "output_dir": str(folder / "out"),
        "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
        "datasets": [{"name": "D", "path": str(folder / "src.jsonl"), "format": "conversations", "token_budget": 1000}],
        "target": {"model": str(model), **target},
        "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.0},
        **(sections or {}),
    }
    return parse_run(data, origin=str(folder / "run.toml"), base_dir=folder)


def test_remote_code_is_off_unless_the_run_file_says_so(tmp_path, zoo_files):
    config = _config(tmp_path, zoo_files("qwen3-8b"))
    assert config.target.trust_remote_code is False


# ---- 1. remote code: an explicit opt-in, a clear error, never another tokenizer ------------------


def test_prepare_refuses_a_tokenizer_that_is_the_models_own_code_without_the_opt_in(tmp_path, zoo_model):
    """Kimi's tokenizer is tokenization_kimi.TikTokenTokenizer: without the opt-in prepare must
    say which key to set, not load some other tokenizer built from tiktoken.model."""
    config = _config(tmp_path, zoo_model("kimi-k2.5"))
    with pytest.raises(ConfigError, match=r"\[target\] trust_remote_code"):
        run_stage(config, "prepare")


def test_loading_a_model_that_is_its_own_code_names_the_opt_in(zoo_model):
    from eagleops.pipeline.training.modeling.target import load_target

    with pytest.raises(ConfigError, match=r"\[target\] trust_remote_code"):
        load_target(TargetConfig(model=zoo_model("kimi-k2.5")))


def test_with_the_opt_in_prepare_tokenizes_with_the_models_own_tokenizer(tmp_path, zoo_model):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    folder = zoo_model("kimi-k2.5")
    config = _config(tmp_path, folder, trust_remote_code=True)
    run_stage(config, "prepare")
    kimi = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    assert type(kimi).__name__ == "TikTokenTokenizer"
    own = kimi.encode(" 中文 and more text.", add_special_tokens=False)
    trained = [int(t) for shard in sorted(config.prepared_dir.glob("shard-*.safetensors")) for t in load_file(str(shard))["input_ids"]]
    assert ",".join(map(str, own)) in ",".join(map(str, trained)), "prepare did not use Kimi's own splits"


# ---- 2. wrapped targets: the language model found from its text config and weight map ------------


def test_a_wrapped_targets_head_and_embeddings_come_from_its_weight_map(zoo_model):
    import torch
    from safetensors import safe_open

    from eagleops.pipeline.config import TargetConfig
    from eagleops.pipeline.training.modeling.profile import head_and_embeddings, learn_profile

    folder = zoo_model("kimi-k2.5")
    head, embeddings = head_and_embeddings(learn_profile(TargetConfig(model=folder, trust_remote_code=True)))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index["language_model.lm_head.weight"]), framework="pt") as f:
        assert torch.equal(head, f.get_tensor("language_model.lm_head.weight"))
    assert embeddings.shape == head.shape == (163840, 64)
    assert not torch.equal(head, embeddings)


def test_extract_reads_a_wrapped_targets_decoder_stack(zoo_model):
    import torch

    from eagleops.pipeline.training.extract.hf import forward_features
    from eagleops.pipeline.training.modeling.target import load_target

    model, device, _ = load_target(TargetConfig(model=zoo_model("kimi-k2.5"), trust_remote_code=True))
    ids = torch.tensor([5, 6, 7, 8])
    aux, final = forward_features(model, [ids], (1, 3, 4), device)
    with torch.no_grad():
        direct = model.language_model.model(input_ids=ids[None], output_hidden_states=True)
    assert aux.shape == (1, 4, 3 * 64)
    assert torch.allclose(final, direct.last_hidden_state)
    assert torch.allclose(aux[..., :64], direct.hidden_states[2])  # our layer 1 = its output


@pytest.mark.parametrize(
    ("layout", "head"),
    [
        ("model.language_model.", "lm_head.weight"),  # a transformers-5 VLM (Qwen2.5-VL, Gemma 3)
        ("language_model.model.", "language_model.lm_head.weight"),  # LLaVA-style
        ("model.language_model.", None),  # tied: the embeddings are the head
    ],
)
def test_any_wrappers_language_model_is_found_beside_its_vision_tower(tmp_path, layout, head):
    import torch
    from safetensors.torch import save_file

    from eagleops.pipeline.training.modeling.target import language_model_weights, weight_map

    config = {"architectures": ["SomeVLForConditionalGeneration"], "vision_config": {"depth": 2}}
    config["text_config"] = {"num_hidden_layers": 2, "hidden_size": 4, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {f"{layout}embed_tokens.weight": torch.zeros(10, 4), f"{layout}norm.weight": torch.ones(4)}
    tensors.update({f"{layout}layers.{i}.mlp.weight": torch.zeros(4, 4) for i in range(2)})
    tensors.update({f"model.visual.blocks.{i}.weight": torch.zeros(4, 4) for i in range(2)})
    tensors["model.visual.embed_tokens.weight"] = torch.zeros(3, 4)  # a tower with its own embeddings
    if head:
        tensors[head] = torch.ones(10, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert language_model_weights(weight_map(tmp_path), 2, tmp_path) == (
        head or f"{layout}embed_tokens.weight",
        f"{layout}embed_tokens.weight",
    )


# ---- 3. one vocabulary size: the head's rows ----------------------------------------------------


def test_prepare_and_the_drafter_agree_on_the_heads_rows_when_the_tokenizer_is_shorter(tmp_path, zoo_model):
    """Qwen3: 151,669 tokenizer ids, 151936 head rows. t2d, the drafter and its embeddings all
    take the head's rows, or training crashes on the mismatch."""
    from safetensors.torch import load_file

    from eagleops.pipeline.training.artifacts import DRAFT_VOCAB, PreparedIndex
    from eagleops.pipeline.training.modeling.drafter import build_drafter

    config = _config(tmp_path, zoo_model("qwen3-8b"))
    run_stage(config, "prepare")
    index = PreparedIndex.read_if_present(config.prepared_dir)
    assert index is not None and index.vocab_size == 151936
    assert load_file(str(config.prepared_dir / DRAFT_VOCAB))["t2d"].shape == (151936,)
    drafter = build_drafter(config, (1, 3, 4), seed=0)
    assert drafter.t2d.shape == (151936,) and drafter.embed_tokens.weight.shape[0] == 151936


# ---- 10. the speculators export names the real verifier ----------------------------------------


@pytest.mark.parametrize("target", ["deepseek-v3.1", "kimi-k2.5", "gpt-oss-20b", "qwen3-8b"])
def test_the_speculators_config_names_the_verifiers_own_architecture(target, zoo_files):
    from eagleops.pipeline.training.artifacts import CaptureLayout
    from eagleops.pipeline.training.export.speculators import speculators_config

    folder = zoo_files(target)
    server = {"draft_vocab_size": 64, "target_hidden_size": 64, "hidden_size": 64}
    real = json.loads((folder / "config.json").read_text())["architectures"]
    exported = speculators_config(server, CaptureLayout((1, 3, 4), 64), folder, real, draft_tokens=4)
    assert exported["speculators_config"]["verifier"]["architectures"] == real


@pytest.mark.parametrize(
    ("target", "options", "thinking"),
    [
        ("kimi-k2.5", {"trust_remote_code": True}, "keep"),
        ("qwen3-8b", {}, "keep"),
        ("deepseek-v3.1", {}, "keep"),
        ("gpt-oss-20b", {}, "keep"),
        ("llama-3.1-8b-instruct", {}, "drop"),
    ],
)
async def test_a_real_targets_stand_in_goes_through_every_stage(tmp_path, zoo_model, fault_server, target, options, thinking):
    """Every zoo target, among them Kimi-K2.5 (a wrapper, remote code), Qwen3 and DeepSeek-V3.1
    (tokenizers shorter than the head): generate (a server answering as the model does, thinking
    included, whole chats and chats after a tool call), prepare, extract, train, export and eval
    run; eval replays the prompts the server was fed; the export names the real verifier."""
    from eagleops.pipeline.engine import Engine
    from eagleops.pipeline.protocol.events import StageStatus
    from tests.conftest import make_config
    from tests.e2e.test_zoo_pipeline import SERVED_AS, _sources

    folder = zoo_model(target)
    chats, tools = _sources(tmp_path, SERVED_AS[target])
    datasets = [
        {"name": "chats", "path": str(chats), "format": "conversations", "token_budget": "1M", "regenerate": "all"},
        {"name": "tools", "path": str(tools), "format": "messages", "token_budget": "1M", "regenerate": "all"},
    ]
    fault_server.reset()
    sections = {**STAGE_SETTINGS, "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.2, "eval_max": 2}}
    config = make_config(tmp_path, fault_server.base_url, datasets, thinking=thinking, target={"model": str(folder), **options}, **sections)
    stages = ("generate", "prepare", "extract", "train", "export", "eval")
    summary = await Engine(config, stages=stages).run()
    assert all(summary.stages[s] == StageStatus.DONE for s in stages), summary.stages
    held = [json.loads(line) for line in (config.prepared_dir / "eval.jsonl").read_text().splitlines()]
    assert held and all(row["prompt_ids"] for row in held)
    from tests.unit.test_target_formats import PROMPT_ENDS

    if (target, thinking) in PROMPT_ENDS:  # the prompt in the mode's own words (V3.1: thinking on)
        tokenizer = _own_tokenizer(folder, target)
        assert all(tokenizer.decode(row["prompt_ids"]).endswith(PROMPT_ENDS[(target, thinking)]) for row in held)
    exported = json.loads((config.export_dir.with_name(config.export_dir.name + "-speculators") / "config.json").read_text())
    assert exported["speculators_config"]["verifier"]["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]


# ---- 9. a turn ends with the template's own token, not necessarily the tokenizer's eos ----------

TURN_ENDS = {
    "kimi-k2.5": "<|im_end|>",  # its eos is [EOS]
    "qwen3-8b": "<|im_end|>",
    "deepseek-v3.1": "<｜end▁of▁sentence｜>",
    "gpt-oss-20b": "<|return|>",  # <|end|> closes a turn only in the history
    "llama-3.1-8b-instruct": "<|eot_id|>",
}


def _own_tokenizer(folder, target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=target.startswith("kimi"))


@pytest.mark.parametrize("target", sorted(TURN_ENDS))
def test_the_turn_end_is_learned_from_the_chat_template(target, zoo_files):
    from eagleops.pipeline.training.modeling.turns import reply_stop_ids, turn_ends

    folder = zoo_files(target)
    tokenizer = _own_tokenizer(folder, target)
    ends = turn_ends(tokenizer)
    assert tokenizer.convert_ids_to_tokens(ends[0]) == TURN_ENDS[target]
    listed = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    stops = reply_stop_ids(tokenizer, folder)
    assert ends[0] in stops and set(listed if isinstance(listed, list) else [listed]) <= stops


@pytest.mark.parametrize("target", ["kimi-k2.5", "qwen3-8b"])
def test_the_generated_ids_are_trained_up_to_the_turn_end_not_the_eos(target, zoo_files):
    """Kimi ends a turn with <|im_end|> while its eos is [EOS]; Qwen3's template writes a newline
    after <|im_end|>: the server's ids are the reply, its turn end trained, nothing after it."""
    from tests.conftest import builder_for

    folder = zoo_files(target)
    tokenizer = _own_tokenizer(folder, target)
    end = tokenizer.convert_tokens_to_ids(TURN_ENDS[target])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache keeps tokens"}]
    before = tokenizer.apply_chat_template(
        messages[:1],
        add_generation_prompt=True,
        tokenize=True,
        **({"enable_thinking": False} if target == "qwen3-8b" else {"thinking": False}),
    )
    before = list(before["input_ids"] if hasattr(before, "keys") else before)
    reply = [tok for ch in "the cache keeps tokens" for tok in tokenizer.encode(ch, add_special_tokens=False)]
    [sample] = builder_for(tokenizer, folder).build(messages, None, "off", exact=[*reply, end])
    assert sample.ids == [*before, *reply, end] and sample.mask == [0] * len(before) + [1] * (len(reply) + 1)


def test_eval_stops_a_kimi_reply_at_its_turn_end(tmp_path, zoo_model, monkeypatch):
    """Kimi's replies end with <|im_end|>, not its eos [EOS]: offline eval must stop on it (and on
    generation_config's eos ids), or it measures acceptance on text the target never serves."""
    from transformers import AutoTokenizer

    import eagleops.pipeline.training.eval.stage as eval_stage

    folder = zoo_model("kimi-k2.5")
    sections = {**STAGE_SETTINGS, "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.1, "eval_max": 2}}
    config = _config(tmp_path, folder, sections, trust_remote_code=True)
    run_stage(config, "prepare")
    seen = {}

    def offline(config, ctx, prompts, stops, *, untrained):
        seen["stops"] = set(stops)
        raise RuntimeError("stops seen")

    monkeypatch.setattr(eval_stage, "evaluate_offline", offline)
    with pytest.raises(RuntimeError, match="stops seen"):
        eval_stage.evaluate(config, eval_stage.StageContext("eval"), untrained=True)
    kimi = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    assert kimi.convert_tokens_to_ids("<|im_end|>") in seen["stops"]


def test_speculative_decoding_stops_on_any_of_the_replys_stop_ids():
    """gpt-oss and Llama-3.1 list several eos ids: the reply ends at the first of any of them."""
    import torch

    from eagleops.pipeline.training.eval.decoding import speculative_generate

    script = [5, 6, 9, 7, 8]  # the target's greedy continuation; 9 is one of several stop ids

    class Target:  # CachedTarget's interface: after the prompt, the script one token a position
        length = 0

        def reset(self):
            self.length = 0

        def feed(self, ids, last_only=False):
            start, self.length = self.length, self.length + len(ids)
            greedy = [script[min(max(p - 1, 0), len(script) - 1)] for p in range(start, self.length)]
            return torch.zeros(1, len(ids), 12), greedy

        def crop(self, length):
            self.length = min(self.length, length)

    class Session:
        def extend(self, aux, next_tokens):
            pass

        def propose(self, k):
            return [0] * k

    drafter = type("Drafter", (), {"session": lambda self: Session()})()
    generated, _ = speculative_generate(Target(), drafter, [1, 2], k=2, max_new_tokens=8, stops={3, 9})
    assert generated == [5, 6]


# ---- 6. thinking off in each template's own words -----------------------------------------------

OWN_SWITCH = {
    "kimi-k2.5": {"thinking": False},
    "deepseek-v3.1": {"thinking": False},
    "qwen3-8b": {"enable_thinking": False},
    "gpt-oss-20b": {"reasoning_effort": "low"},  # it cannot stop thinking: the least it does
}


@pytest.mark.parametrize("target", sorted(OWN_SWITCH))
def test_thinking_off_is_learned_from_the_chat_template(target, zoo_files):
    from eagleops.pipeline.training.modeling.thinking_switch import thinking_off_kwargs

    assert thinking_off_kwargs(_own_tokenizer(zoo_files(target), target)) == OWN_SWITCH[target]


async def test_generate_turns_thinking_off_with_the_targets_own_switch(tmp_path, zoo_files, fault_server):
    """Kimi-K2.5's template reads `thinking`, not `enable_thinking`: generate asks for what the
    configured target reads; without a target, the run file's `thinking_off_kwargs` says."""
    from eagleops.pipeline.engine import Engine
    from tests.conftest import make_config, write_jsonl

    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": f"q {i} [[think:reasoning]]"} for i in range(3)])
    datasets = [{"name": "A", "path": str(source), "token_budget": "1M", "thinking": "off"}]
    fault_server.reset()
    config = make_config(
        tmp_path, fault_server.base_url, datasets, target={"model": str(zoo_files("kimi-k2.5")), "trust_remote_code": True}
    )
    assert (await Engine(config, stages=("generate",)).run()).ok
    assert fault_server.stats()["thinking_off_thinking"] == 3 and fault_server.stats()["thinking_off_enable_thinking"] == 0
    fault_server.reset()
    sampling = {"max_tokens": 64, "thinking_off_kwargs": {"thinking": False}}
    config = make_config(tmp_path / "plain", fault_server.base_url, datasets, sampling=sampling)
    assert (await Engine(config, stages=("generate",)).run()).ok
    assert fault_server.stats()["thinking_off_thinking"] == 3


@pytest.mark.parametrize(
    ("target", "thinking", "counted"),
    [
        ("deepseek-v3.1", "keep", "thinking_on_thinking"),  # V3.1 thinks only when asked
        ("deepseek-v3.1", "drop", "thinking_on_thinking"),
        ("qwen3-8b", "keep", "thinking_on_enable_thinking"),
        ("gpt-oss-20b", "off", "thinking_off_reasoning_effort"),  # top-level and in the template's words
        ("llama-3.1-8b-instruct", "off", "thinking_off_enable_thinking"),  # no switch of its own: the common one
    ],
)
async def test_generate_asks_for_thinking_in_the_targets_own_words(tmp_path, zoo_files, fault_server, target, thinking, counted):
    from eagleops.pipeline.engine import Engine
    from tests.conftest import make_config, write_jsonl

    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": f"q {i} [[think:reasoning]]"} for i in range(2)])
    datasets = [{"name": "A", "path": str(source), "token_budget": "1M", "thinking": thinking}]
    fault_server.reset()
    config = make_config(tmp_path, fault_server.base_url, datasets, target={"model": str(zoo_files(target))})
    assert (await Engine(config, stages=("generate",)).run()).ok
    assert fault_server.stats()[counted] == 2


@pytest.mark.parametrize("target", ["llama-3.1-8b-instruct", "kimi-k2.5"])
def test_the_model_server_stops_on_every_eos_id_the_model_lists(target, zoo_files):
    """Llama-3.1 lists three eos ids, Kimi lists <|im_end|> (its tokenizer's eos is [EOS]): the
    loopback model server stops on each, as vLLM does, not only on the tokenizer's eos."""
    from transformers import GenerationConfig

    from eagleops.pipeline.demo.model_server import reply_stop_ids

    folder = zoo_files(target)
    tokenizer = _own_tokenizer(folder, target)
    listed = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    stops = reply_stop_ids(GenerationConfig.from_pretrained(str(folder)), tokenizer)
    assert set(listed if isinstance(listed, list) else [listed]) | {tokenizer.eos_token_id} == set(stops)
