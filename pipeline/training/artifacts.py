"""What the ML stages hand each other, typed: the prepared index, the features index with its
capture layout, the training checkpoint and each stage's result. The JSON on disk is these
dataclasses' fields.

The capture layout (which target layers were captured, their width, how they are stored) has
one home: ``features/index.json``, written by extract. The checkpoint and the export carry the
copy their drafter was trained with, and whoever reads two of them checks that they agree
(``CaptureLayout.require_match``): a drafter fed other layers than it learned on is wrong
without failing anywhere."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.files import fsync_dir, write_json_atomic
from eagleops.pipeline.layout import DRAFT_VOCAB, INDEX

__all__ = [
    "DRAFT_VOCAB",
    "INDEX",
    "CaptureLayout",
    "CaptureMismatch",
    "Checkpoint",
    "EvalResult",
    "ExportResult",
    "FeatureShard",
    "FeaturesIndex",
    "NewerSchema",
    "PreparedIndex",
    "PreparedShard",
    "TrainResult",
    "features_capture",
    "load_prepared",
]


class NewerSchema(RunError):
    """A record written by a newer eagleops than this one: never read as if it were ours, nor
    overwritten."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: missing; run {what} first") from None
    except (OSError, ValueError) as exc:
        raise RunError(f"{path}: unreadable ({exc})") from None


def _unversioned(data: dict[str, Any], schema: int, what: str) -> dict[str, Any]:
    """``data`` without its ``schema`` (a record from before versions is version 1), refused when
    a newer eagleops wrote it."""
    found = data.get("schema", 1)
    if not isinstance(found, int) or found > schema:
        raise NewerSchema(f"{what}: schema {found!r}, written by a newer eagleops (this one reads up to {schema}); upgrade eagleops")
    return {k: v for k, v in data.items() if k != "schema"}


@dataclass(frozen=True)
class PreparedShard:
    file: str
    samples: int
    tokens: int


@dataclass(frozen=True)
class PreparedIndex:
    """``prepared/index.json``: tokenized shards, the draft vocabulary's reach, what was dropped."""

    SCHEMA: ClassVar[int] = 1

    fingerprint: str
    samples: int
    tokens: int
    assistant_tokens: int
    duplicates_dropped: int
    truncated: int
    held_out: int
    max_length: int
    vocab_size: int
    draft_vocab_size: int
    draft_vocab_coverage: float
    tokenizer: str
    shards: tuple[PreparedShard, ...]
    retokenized_mismatches: int = 0  # replies whose template render differs from the ids generated
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # samples left out, by reason (prepare's ``DROPPED_AS``)
    served_prompts: int = 0  # prompts trained on as the server fed them (its token ids)
    prompt_mismatches: int = 0  # of those, ones the template's rendering of the record does not give

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], what: str = "prepared index") -> PreparedIndex:
        data = _unversioned(data, cls.SCHEMA, what)
        return cls(**{**data, "shards": tuple(PreparedShard(**s) for s in data["shards"])})

    @classmethod
    def read(cls, directory: Path) -> PreparedIndex:
        return cls.from_json(_read_json(directory / INDEX, "prepare"), str(directory / INDEX))

    @classmethod
    def read_if_present(cls, directory: Path) -> PreparedIndex | None:
        path = directory / INDEX
        if not path.exists():
            return None
        try:
            return cls.read(directory)
        except NewerSchema:
            raise
        except (RunError, TypeError, KeyError):
            return None  # an index of another version: prepare again

    def write(self, directory: Path) -> None:
        (directory / INDEX).write_text(json.dumps(self.to_json(), indent=1))


def load_prepared(directory: Path) -> tuple[PreparedIndex, list[tuple[Any, Any]]]:
    """The index and [(input_ids, loss_mask)] tensors of every prepared sample, in order."""
    from safetensors.torch import load_file

    index = PreparedIndex.read(directory)
    samples = []
    for shard in index.shards:
        tensors = load_file(str(directory / shard.file))
        offsets = tensors["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:], strict=False):
            samples.append((tensors["input_ids"][a:b], tensors["loss_mask"][a:b]))
    return index, samples


class CaptureMismatch(RunError):
    """Two records of the same run disagree on the capture layout: features extracted again with
    other layers than a checkpoint or an export was trained on."""


@dataclass(frozen=True)
class CaptureLayout:
    """What extract captures of the target per token: the outputs of ``aux_layers`` (our 0-based
    numbering; ``modeling.layers`` converts to each engine's), ``hidden_size`` wide each, stored
    as ``storage`` ("bf16", or "fp8": e4m3 with a scale per token and layer). ``storage`` is None
    where a record does not say (an exported drafter's config)."""

    aux_layers: tuple[int, ...]
    hidden_size: int
    storage: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"aux_layers": list(self.aux_layers), "hidden_size": self.hidden_size, "storage": self.storage}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaptureLayout:
        return cls(tuple(int(i) for i in data["aux_layers"]), int(data["hidden_size"]), data.get("storage"))

    def describe(self) -> str:
        return f"aux layers {list(self.aux_layers)}, hidden size {self.hidden_size}"

    def require_match(self, source: Path, other: CaptureLayout, other_source: Path, remedy: str) -> None:
        """Raise ``CaptureMismatch`` naming both records unless a drafter reads the same from
        both: the same layers at the same width (storage is the features' own affair)."""
        if (self.aux_layers, self.hidden_size) != (other.aux_layers, other.hidden_size):
            raise CaptureMismatch(f"{source} has {self.describe()} but {other_source} has {other.describe()}: {remedy}")


@dataclass(frozen=True)
class FeatureShard:
    first_sample: int
    samples: int
    tokens: int
    bytes: int


@dataclass
class FeaturesIndex:
    """``features/index.json``, rewritten atomically as each shard lands (so extract resumes)."""

    SCHEMA: ClassVar[int] = 1

    prepared: str
    aux_layers: list[int]
    hidden_size: int
    num_layers: int
    target: str
    shards: dict[str, FeatureShard] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    storage: str = "bf16"  # or "fp8": e4m3 with a scale per token (and per layer)
    samples: int | None = None  # every prepared sample, extracted or not yet: a following train knows its length
    shard_samples: int | None = None  # shard k holds samples [k * shard_samples, (k + 1) * shard_samples)
    complete: bool = False  # extract wrote its last shard
    run_token: str = ""  # new each time an extract starts: a train's "finished" names the extract it ended under

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], what: str = "features index") -> FeaturesIndex:
        data = _unversioned(data, cls.SCHEMA, what)
        return cls(**{**data, "shards": {name: FeatureShard(**s) for name, s in data.get("shards", {}).items()}})

    @classmethod
    def read(cls, directory: Path) -> FeaturesIndex:
        return cls.from_json(_read_json(directory / INDEX, "extract"), str(directory / INDEX))

    @classmethod
    def read_if_present(cls, directory: Path) -> FeaturesIndex | None:
        if not (directory / INDEX).exists():
            return None
        try:
            return cls.read(directory)
        except NewerSchema:
            raise
        except (RunError, TypeError, KeyError):
            return None

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / INDEX, self.to_json())

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards.values())

    @property
    def stored_bytes(self) -> int:
        return sum(s.bytes for s in self.shards.values())

    def ordered_shards(self) -> list[tuple[str, FeatureShard]]:
        return sorted(self.shards.items(), key=lambda item: item[1].first_sample)

    @property
    def capture(self) -> CaptureLayout:
        return CaptureLayout(tuple(self.aux_layers), self.hidden_size, self.storage)


def features_capture(directory: Path) -> tuple[CaptureLayout, Path] | None:
    """The capture layout of the features in ``directory`` and the file that holds it, if any."""
    index = FeaturesIndex.read_if_present(directory)
    return (index.capture, directory / INDEX) if index is not None else None


@dataclass
class Checkpoint:
    """``train/checkpoint.pt``: drafter weights (no embeddings), optimiser, schedule, position, and
    the capture layout of the features it was trained on."""

    SCHEMA: ClassVar[int] = 1

    drafter: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    step: int
    history: list[dict[str, Any]]
    capture: CaptureLayout
    drafter_config: dict[str, Any]
    global_batch: int = 0  # samples a step, all ranks: a following train resumes at step x this

    def save(self, path: Path) -> None:
        import torch

        tmp = path.with_name(path.name + ".tmp")
        # not asdict: it deep-copies every tensor of the optimiser state; the layout as plain
        # data, so a checkpoint does not depend on where this class lives
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["capture"] = self.capture.to_json()
        state["schema"] = self.SCHEMA
        with open(tmp, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())  # durable before anything acts on it (a bounded train deletes shards next)
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path, map_location: Any = "cpu") -> Checkpoint:
        import torch

        if not path.exists():
            raise RunError(f"{path}: no checkpoint; run train first")
        state = _unversioned(torch.load(path, map_location=map_location, weights_only=False), cls.SCHEMA, str(path))
        if "capture" in state:
            state["capture"] = CaptureLayout.from_json(state["capture"])
        else:  # saved before the layout had a type: its layers and the drafter's input width
            state["capture"] = CaptureLayout(tuple(state.pop("aux_layers")), int(state["drafter_config"]["target_hidden_size"]))
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float | None
    acc: list[float]
    steps_per_s: float | None
    world_size: int


@dataclass(frozen=True)
class ExportResult:
    dir: str
    tensors: list[str]
    bytes: int


@dataclass(frozen=True)
class EvalResult:
    drafter: str
    prompts: int
    verify_steps: int
    draft_tokens: int
    acceptance_length: float
    acceptance_rate_per_position: list[float]
    greedy_mismatches: int  # outputs with the drafter that differ from plain greedy decoding's
    backend: str = "hf"
    tok_per_s: float | None = None  # served: generated tokens per second with the drafter
    tok_per_s_without_drafter: float | None = None
    benchmark: str = "held-out"  # the held-out prompts, or a benchmark's name
    outputs: int = 0  # outputs compared with plain greedy decoding's (each question's turns)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
