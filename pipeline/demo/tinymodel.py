"""A tiny real target: a Llama with random weights and a BPE tokenizer trained here, offline.

Used by the demo and the tests. Nothing is downloaded: the tokenizer is trained with
``tokenizers`` on text generated from the word list below, and carries a Llama-3-style chat
template so that ``apply_chat_template`` works exactly as it does for a real target.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "sample_text", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]

# Llama-3 turns, with a reasoning target's thinking as Qwen3's template renders it: an assistant
# turn's ``reasoning_content`` as a <think> block, only after the last user turn (earlier turns'
# thinking is dropped from the history), and ``enable_thinking=false`` as an empty block.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' and message['reasoning_content'] is defined and message['reasoning_content']"
    " and loop.index0 > ns.last_user %}<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TEMPLATE_VERSION = 4  # part of the cache key: a built model is rebuilt when its template changes
THINK_TOKENS = ["<think>", "</think>"]

_TOPICS = (
    "python rust kernel cache tensor gradient server request budget token dataset shard layer "
    "attention decoder drafter verify accept latency throughput queue socket manifest resume "
    "garden river mountain bread coffee music letter window winter summer market travel city"
).split()
_WORDS = (
    "the a an of to in on for with and or but is are was be can will how why what when which "
    "explain write show describe compare list give make find use build fix test run read keep "
    "small large fast slow new old good simple clear short long first last next every each some"
).split()


def _successors() -> dict[str, list[str]]:
    """A fixed little 'language': every word has three likely successors. Text drawn from it has
    structure a model can learn and a drafter can anticipate, unlike uniform word salad."""
    chain_rng = random.Random(1234)
    vocabulary = _TOPICS + _WORDS
    return {word: chain_rng.sample(vocabulary, 3) for word in vocabulary}


_NEXT = _successors()


def sample_text(rng: random.Random, words: int) -> str:
    word = rng.choice(_TOPICS + _WORDS)
    out = [word]
    for _ in range(words - 1):
        if rng.random() < 0.08:
            word = rng.choice(_TOPICS + _WORDS)  # now and then a fresh start
        else:
            word = rng.choices(_NEXT[word], weights=(0.75, 0.17, 0.08))[0]
        out.append(word)
    sentence = " ".join(out)
    return sentence[:1].upper() + sentence[1:] + rng.choice([".", "?", "!"])


def _train_tokenizer(directory: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [sample_text(rng, rng.randint(4, 30)) for _ in range(4000)]
    corpus += [" ".join(_TOPICS), " ".join(_WORDS), "0 1 2 3 4 5 6 7 8 9 ( ) [ ] { } : ; , . ! ? ' \" - + = * / \\ _ # @ $ % & < > |"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
    )
    # ordinary added tokens, as Qwen3's are: kept in decoded text, one id each for reasoning parsers
    fast.add_tokens(THINK_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def _pretrain(model, tokenizer, steps: int, seed: int, think_share: float, batch: int = 16, length: int = 96) -> None:
    import torch

    rng = random.Random(seed + 1)
    torch.manual_seed(seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            reply = {"role": "assistant", "content": sample_text(rng, rng.randint(6, 24))}
            if rng.random() < think_share:  # a reasoning target: some answers think first
                reply["reasoning_content"] = sample_text(rng, rng.randint(4, 14))
            conversation = [{"role": "user", "content": sample_text(rng, rng.randint(4, 16))}, reply]
            ids = tokenizer.apply_chat_template(conversation, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:length]
            rows.append(ids + [tokenizer.pad_token_id] * (length - len(ids)))
        input_ids = torch.tensor(rows)
        labels = input_ids.masked_fill(input_ids == tokenizer.pad_token_id, -100)
        loss = model(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def build_tiny_model(
    directory: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    layers: int = 8,
    heads: int = 2,  # head_dim 32: the smallest vLLM's CPU attention backend takes
    kv_heads: int = 1,
    intermediate_size: int = 176,
    max_positions: int = 2048,
    seed: int = 0,
    stop_bias: float = 0.0,
    init_std: float = 0.2,
    branch_scale: float = 1.0,
    pretrain_steps: int = 0,
    think_share: float = 0.3,
    architecture: str = "llama",
) -> Path:
    """Write a tokenizer + random-weight LlamaForCausalLM to ``directory`` (once; cached).

    ``architecture = "deepseek_v3"`` writes the shape of the real users' target instead
    (Kimi-K2.5 is a DeepSeek-V3): MLA attention, a dense first layer, then mixture-of-experts
    layers with a shared expert, in sharded safetensors, at tiny sizes.

    ``stop_bias`` scales the end-of-turn row of the output head so that sampled answers end at
    varied lengths, as a real model's do (random weights would almost never stop).
    ``pretrain_steps`` > 0 then trains the random model briefly (seconds on a CPU) on chat
    conversations of the generated text: a random net's next token is close to chance, which no
    drafter can predict, while a trained model's next token has structure, as a real target's
    does. ``branch_scale`` shrinks every residual branch at init.
    """
    directory = Path(directory)
    marker = directory / "eagleops-tiny.json"
    spec = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "layers": layers, "heads": heads,
        "kv_heads": kv_heads, "intermediate_size": intermediate_size, "max_positions": max_positions,
        "seed": seed, "stop_bias": stop_bias, "init_std": init_std, "branch_scale": branch_scale,
        "pretrain_steps": pretrain_steps, "template": TEMPLATE_VERSION, "think_share": think_share,
        "architecture": architecture,
    }  # fmt: skip
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    directory.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(directory, vocab_size, seed)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    torch.manual_seed(seed)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": max_positions,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "initializer_range": init_std,
    }
    config = _architecture_config(architecture, common, kv_heads)
    model = AutoModelForCausalLM.from_config(config)
    _scale_weights(model, tokenizer.eos_token_id, branch_scale, stop_bias)
    if pretrain_steps:
        _pretrain(model, tokenizer, pretrain_steps, seed, think_share)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # the MoE target in several shards, as a real one is: the stages read its head and embeddings alone
    model.save_pretrained(str(directory), **({"max_shard_size": "400KB"} if architecture != "llama" else {}))
    marker.write_text(json.dumps(spec))
    return directory


def _scale_weights(model, eos_token_id: int, branch_scale: float, stop_bias: float) -> None:
    import torch

    with torch.no_grad():
        if branch_scale != 1.0:
            for name, weight in model.named_parameters():
                if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
                    weight *= branch_scale
        if stop_bias:
            model.lm_head.weight[eos_token_id] *= stop_bias


def _architecture_config(architecture: str, common: dict, kv_heads: int):
    if architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_key_value_heads=kv_heads)
    if architecture == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **common,
            num_key_value_heads=common["num_attention_heads"],
            moe_intermediate_size=common["intermediate_size"] // 4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
        )
    raise ValueError(f"unknown tiny architecture {architecture!r} (llama or deepseek_v3)")
