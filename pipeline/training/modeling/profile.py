"""The target, learned once per run: what every stage needs to know of it, read from its files
one time and kept as ``target-profile.json`` in the output directory, keyed by a fingerprint of
those files. The engine learns it before generate (its thinking switch), each stage takes it
from there (a torchrun rank, a later ``eagleops train``: the file), and a target whose files
change is learned again.

What it holds: the language model's sizes and class names, the output head's rows and the
tensor names (and files) of its head and embeddings, whether vLLM serves it as a multimodal
model, and the chat template's thinking switch. The transformers config object is learned in
the same read and kept for this process (``target_config``); nothing else reads config.json or
the weight index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig, TargetConfig
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.files import write_json_atomic
from eagleops.pipeline.training.modeling import target as target_files
from eagleops.pipeline.training.modeling.thinking_switch import ThinkingSwitch, learn_thinking_switch, require_thinking_can_stop

__all__ = [
    "HeadWeights",
    "PROFILE_SCHEMA",
    "TargetProfile",
    "fingerprint_target",
    "head_and_embeddings",
    "learn_profile",
    "target_config",
    "target_profile",
    "with_target_thinking_switch",
]

PROFILE_SCHEMA = 1
# the files whose content is the target as the stages see it (weights aside: their index, or the
# one file's size and time, stand for them)
_DESCRIBING = ("config.json", "model.safetensors.index.json", "generation_config.json")
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "tiktoken.model", "chat_template.jinja",
                    "chat_template.json", "special_tokens_map.json")  # fmt: skip


@dataclass(frozen=True)
class HeadWeights:
    """Where the output head and the embeddings are in the checkpoint, and the head's rows."""

    rows: int  # the vocabulary every stage sizes by: a config's vocab_size pads past the tokenizer
    head_tensor: str
    embed_tensor: str  # the head's own name where the head is tied
    files: dict[str, str]  # head and embedding tensor -> the safetensors file holding it


@dataclass(frozen=True)
class TargetProfile:
    model: str
    fingerprint: str
    architectures: tuple[str, ...]
    num_layers: int  # the language model's decoder layers
    hidden_size: int
    multimodal: bool  # vLLM serves it as a multimodal model (a wrapper with a text_config)
    thinking_switch: ThinkingSwitch | None  # the chat template's; None where it reads none
    weights: HeadWeights | None  # None: a checkpoint without weights (enough for `eagleops inspect`)
    weights_missing: str = ""  # why there are none
    schema: int = PROFILE_SCHEMA

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["architectures"] = list(self.architectures)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TargetProfile:
        switch, weights = data.get("thinking_switch"), data.get("weights")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{
            **{k: v for k, v in data.items() if k in fields},
            "architectures": tuple(data["architectures"]),
            "thinking_switch": ThinkingSwitch(**switch) if switch else None,
            "weights": HeadWeights(**weights) if weights else None,
        })  # fmt: skip

    @property
    def head(self) -> HeadWeights:
        """The head's weights; an InputError naming the checkpoint where it has none."""
        if self.weights is None:
            raise InputError(self.weights_missing or f"{self.model}: no weights")
        return self.weights

    @property
    def head_rows(self) -> int:
        return self.head.rows


def fingerprint_target(target: TargetConfig) -> str:
    """A digest of the files the profile is learned from: their content (small JSON, the
    tokenizer, the model's own code), and for a single-file checkpoint its size and time."""
    digest = hashlib.sha256()
    folders = [(Path(target.model), _DESCRIBING), (Path(target.tokenizer_path), _TOKENIZER_FILES)]
    for folder, names in folders:
        own_code = sorted(p.name for p in folder.glob("*.py"))  # a remote-code config or tokenizer (Kimi's)
        for name in (*names, *own_code):
            path = folder / name
            if path.is_file():
                digest.update(f"{path}\0".encode())
                digest.update(path.read_bytes())
    single = Path(target.model) / "model.safetensors"
    if single.is_file():
        stat = single.stat()
        digest.update(f"{single}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    digest.update(f"remote code {target.trust_remote_code}".encode())
    return digest.hexdigest()[:16]


_lock = threading.Lock()
_learned: dict[str, tuple[TargetProfile, Any]] = {}  # fingerprint -> (profile, transformers config)


def target_profile(config: RunConfig) -> TargetProfile:
    """The run's target profile: this process's, else the output directory's file when it was
    learned from these same files, else learned now (and written there)."""
    target = target_files.require_target(config)
    fingerprint = fingerprint_target(target)
    with _lock:  # two stages side by side (extract and train) learn it once
        if fingerprint in _learned:
            return _learned[fingerprint][0]
        path = config.layout.target_profile
        cached = _read(path, fingerprint)
        if cached is not None:
            _learned[fingerprint] = (cached, None)
            return cached
        profile, loaded = _learn(target, fingerprint)
        _learned[fingerprint] = (profile, loaded)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, profile.to_json())
        return profile


def target_config(config: RunConfig) -> Any:
    """The target's transformers config (a wrapper's: its ``text_config`` is the language
    model's), read once per process with the profile."""
    profile = target_profile(config)
    with _lock:
        loaded = _learned[profile.fingerprint][1]
        if loaded is None:
            loaded = target_files.load_target_config(target_files.require_target(config))
            _learned[profile.fingerprint] = (profile, loaded)
        return loaded


def _read(path: Path, fingerprint: str) -> TargetProfile | None:
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != PROFILE_SCHEMA or data.get("fingerprint") != fingerprint:
            return None
        return TargetProfile.from_json(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InputError(f"{path}: not a target profile eagleops can read ({exc!r}); delete it to learn the target again") from None


def learn_profile(target: TargetConfig) -> TargetProfile:
    """The profile of ``target`` learned from its files now, cached nowhere (tools and tests;
    a run takes ``target_profile``)."""
    return _learn(target, fingerprint_target(target))[0]


def _learn(target: TargetConfig, fingerprint: str) -> tuple[TargetProfile, Any]:
    model_dir = Path(target.model)
    loaded = target_files.load_target_config(target)
    text = getattr(loaded, "text_config", None) or loaded
    raw = target_files.raw_config(model_dir)
    weights, missing = None, ""
    try:
        weight_map = target_files.weight_map(model_dir)
    except InputError as exc:
        missing = str(exc)
    else:
        head, embed = target_files.language_model_weights(weight_map, int(text.num_hidden_layers), model_dir)
        rows = target_files.tensor_rows(model_dir / weight_map[head], head)
        weights = HeadWeights(rows, head, embed, {head: weight_map[head], embed: weight_map[embed]})
    profile = TargetProfile(
        model=str(model_dir),
        fingerprint=fingerprint,
        architectures=tuple(raw.get("architectures") or ()),
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        multimodal=target_files.is_multimodal(raw),
        thinking_switch=learn_thinking_switch(target_files.load_target_tokenizer(target)),
        weights=weights,
        weights_missing=missing,
    )
    return profile, loaded


def head_and_embeddings(profile: TargetProfile) -> tuple[Any, Any]:
    """(lm_head weight, token embedding weight) read from the checkpoint alone (never the whole
    model); a tied head is the embedding."""
    head = profile.head
    tensors = target_files.load_target_tensors(Path(profile.model), head.files)
    return tensors[head.head_tensor], tensors[head.embed_tensor]


def with_target_thinking_switch(config: RunConfig) -> RunConfig:
    """The run with ``[sampling] thinking_off_kwargs`` and ``thinking_on_kwargs`` from the
    target's template (its profile) where the run file does not set them, handed to generate as
    plain data: generate stays free of transformers. A ``thinking = "off"`` the target cannot
    honour is refused here, before anything is sent (the one check that reads the template)."""
    if config.target is None:
        return config
    switch = target_profile(config).thinking_switch
    sampling = config.sampling
    if switch is not None:
        sampling = replace(
            sampling,
            thinking_off_kwargs=sampling.thinking_off_kwargs if sampling.thinking_off_kwargs is not None else switch.kwargs("off"),
            thinking_on_kwargs=sampling.thinking_on_kwargs if sampling.thinking_on_kwargs is not None else switch.kwargs("keep"),
        )
        config = replace(config, sampling=sampling)
    if any(config.thinking_for(ds) == "off" for ds in config.datasets):
        require_thinking_can_stop(config, target_files.load_target_tokenizer(target_files.require_target(config)))
    return config
