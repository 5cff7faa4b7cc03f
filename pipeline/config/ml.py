"""The ML stages' tables: prepare, extract, train and eval (the run file's other tables are in
``run``). Declared as ``run``'s are: each field once, with its type, default, check and doc."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .fields import BenchmarkConfig
from .schema import Check, at_least, finite_at_least, one_of, setting, within

__all__ = ["DRAFTERS", "EvalConfig", "ExtractConfig", "PrepareConfig", "TrainConfig"]

DRAFTERS = ("eagle3", "eagle3.1", "mla", "mla3.1", "dflash")
BLOCK_DRAFTERS = ("dflash",)  # draft a whole block in one forward (``modeling.dflash``)


@dataclass(frozen=True)
class PrepareConfig:
    """Merge, dedupe, shuffle, chat template, loss masks, draft vocabulary."""

    max_length: int = setting(2048, "tokens per sample at most (longer ones are cut)", check=at_least(1))
    seed: int = setting(0, "shuffle seed")
    draft_vocab_size: int = setting(32000, "draft vocabulary size", check=at_least(1))
    eval_fraction: float = setting(0.05, "share of prompts held out for eval", check=within(0, 1, include_high=False))
    eval_max: int = setting(200, "held-out prompts at most", check=at_least(0))
    extra: tuple[Path, ...] = setting((), 'pre-tokenized JSONL sets: `{"input_ids": [...], "loss_mask": [...]}`')
    shard_samples: int = setting(4096, "samples per prepared shard", check=at_least(1))


def _distinct_layers(layers: tuple[int, ...] | None) -> bool:
    return layers is None or (len(layers) >= 1 and all(x >= 0 for x in layers) and list(layers) == sorted(set(layers)))


@dataclass(frozen=True)
class ExtractConfig:
    """The target's hidden states EAGLE-3 trains on."""

    backend: str = setting(
        "hf",
        "`hf`: transformers on this machine; `vllm`: captured inside vLLM ([serve]), for targets no single device holds",
        check=one_of("hf", "vllm"),
    )
    aux_layers: tuple[int, ...] | None = setting(
        None,
        "layer indices, ascending: three for EAGLE-3 (default `[1, N//2-1, N-4]`), one per drafter layer for dflash (default spread over 1..N-3)",
        check=Check(_distinct_layers, "must be distinct layer indices in ascending order, e.g. [1, 15, 28]"),
    )
    batch_tokens: int = setting(8192, "padded tokens per forward batch", check=at_least(1))
    shard_samples: int = setting(256, "samples per feature shard", check=at_least(1))
    storage: str = setting(
        "bf16",
        "feature storage: `bf16`; `int8` (8 largest values per vector kept exact) or `fp8` (e4m3), about half the bytes (see bench/RESULTS.md)",
        check=one_of("bf16", "int8", "fp8"),
    )
    during_generate: bool = setting(
        False,
        "capture the hidden states while the target eagleops serves ([serve]) generates: extract then only captures what came from other endpoints",
    )
    max_cache_gb: float = setting(
        0.0,
        "with `train.overlap_extract` and one epoch: GB of shards kept on disk; train deletes the shards it has checkpointed past, extract waits for room (0: keep every shard)",
        check=finite_at_least(0),
    )


@dataclass(frozen=True)
class TrainConfig:
    """The drafter's training, with training-time test."""

    epochs: int = setting(5, "passes over the features", check=at_least(1))
    lr: float = setting(3e-5, "peak learning rate", check=Check(lambda v: v > 0, "must be positive"))
    batch_size: int = setting(1, "samples per step (per rank)", check=at_least(1))
    ttt_length: int = setting(7, "unrolled training-time-test steps", check=at_least(1))
    step_weight: float = setting(0.8, "step i's loss is weighted step_weight**i", check=finite_at_least(0))
    warmup_ratio: float = setting(0.015, "share of steps warming up", check=within(0, 1, include_high=False))
    max_grad_norm: float = setting(0.5, "gradient clipping", check=Check(lambda v: v > 0, "must be positive"))
    weight_decay: float = setting(0.0, "AdamW weight decay", check=finite_at_least(0))
    seed: int = setting(0, "initialisation and data order seed")
    drafter: str = setting(
        "eagle3", "`eagle3`, `eagle3.1`, `mla`, `mla3.1` or `dflash` (the README's train stage)", check=one_of(*DRAFTERS)
    )
    drafter_layers: int = setting(
        0, "decoder layers (0: 1 for the EAGLE-3 kinds, the only count they serve; 5 for dflash, its published recipe)", check=at_least(0)
    )
    block_size: int = setting(
        16, "dflash: tokens a block holds, the verified one first; it drafts block_size - 1 in one forward", check=at_least(2)
    )
    anchors: int = setting(
        512, "dflash: blocks trained per sample at most, their first tokens drawn at random among reply tokens", check=at_least(1)
    )
    block_decay: float = setting(
        7.0, "dflash: block position k's loss weighs exp(-(k-1)/block_decay) (0: all alike)", check=finite_at_least(0)
    )
    drafter_heads: int = setting(0, "attention heads (0: chosen for the target's family, see the README)", check=at_least(0))
    drafter_kv_heads: int = setting(0, "KV heads of Llama attention (0: chosen for the target's family)", check=at_least(0))
    drafter_head_dim: int = setting(0, "Llama's head dim, MLA's v_head_dim (0: chosen for the target)", check=at_least(0))
    drafter_intermediate_size: int = setting(0, "the MLP's width (0: the target's dense `intermediate_size`)", check=at_least(0))
    drafter_kv_lora_rank: int = setting(0, "MLA's latent KV width (0: the target's, or 4 x head dim)", check=at_least(0))
    checkpoint_every: int = setting(200, "steps between checkpoints", check=at_least(1))
    max_steps: int = setting(0, "stop after this many steps (0: no cap)", check=at_least(0))
    log_every: int = setting(10, "steps between metrics events", check=at_least(1))
    head_chunk: int = setting(
        32768, "target-head vocabulary rows per chunk when finding the target's top token (0: all at once)", check=at_least(0)
    )
    parallel: str = setting(
        "ddp",
        "under torchrun: `ddp` (each rank holds the drafter) or `fsdp` (FSDP2 `fully_shard`: parameters, gradients and optimiser state sharded)",
        check=one_of("ddp", "fsdp"),
    )
    overlap_extract: bool = setting(
        False,
        "train starts while extract writes, reading shards as they land (samples are shuffled within a shard, not across: prepare shuffled them already)",
    )
    wandb_project: str = setting("", "also log to this Weights & Biases project (offline into the output when `WANDB_API_KEY` is unset)")


@dataclass(frozen=True)
class EvalConfig:
    """Acceptance length by speculative decoding: offline (`hf`), or served by vLLM or SGLang."""

    backend: str = setting(
        "hf",
        "`hf`: our decoding on the transformers target; `vllm` / `sglang`: that server runs target and drafter ([serve])",
        check=one_of("hf", "vllm", "sglang"),
    )
    prompts: int = setting(20, "held-out prompts to decode", check=at_least(1))
    max_new_tokens: int = setting(64, "tokens per prompt", check=at_least(1))
    draft_tokens: int = setting(4, "drafts per verify step", check=at_least(1))
    benchmarks: tuple[BenchmarkConfig, ...] = setting(
        (), "benchmarks (`[[eval.benchmarks]]`) decoded besides the held-out prompts, each reported apart"
    )
