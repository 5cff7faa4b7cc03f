"""The run's output directory, every file in it named once. Whoever writes or reads a file of a
run asks ``RunLayout`` where it is; no other module spells a file name of the output directory.

    OUT/
      .lock  engine.log  target-profile.json  eval.json
      servers/<name>.log  servers/ext/           the servers eagleops starts, and the capture hook
      <dataset>/data.jsonl failed.jsonl manifest.json     generate: one folder per dataset
      <dataset>/captured/capture-<offset>.rank<r>.safetensors   hidden states captured while generating
      prepared/index.json draft_vocab.safetensors eval.jsonl shard-*.safetensors
      features/index.json shard-*.safetensors
      train/checkpoint.pt history.jsonl
      drafter/config.json model.safetensors eval_benchmarks.json    the export SGLang and vLLM load
      drafter-speculators/                                          the same in speculators' format
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DRAFT_VOCAB", "INDEX", "DatasetFiles", "RunLayout"]

INDEX = "index.json"  # prepared/ and features/ each have one
DRAFT_VOCAB = "draft_vocab.safetensors"  # in prepared/


@dataclass(frozen=True)
class DatasetFiles:
    """One dataset's generate output: records appended, failures appended, the atomic manifest."""

    dir: Path

    @property
    def data(self) -> Path:
        return self.dir / "data.jsonl"

    @property
    def failed(self) -> Path:
        return self.dir / "failed.jsonl"

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    @property
    def captured(self) -> Path:
        """The hidden states the serving target captured while it generated (``during_generate``)."""
        return self.dir / "captured"

    def capture_chunk(self, data_offset: int) -> Path:
        """The stem of the chunk whose records start at ``data_offset`` of data.jsonl: a kill
        between the chunk and its records leaves a chunk at or past the data's end, which the
        next open removes (and the same batch, made again, would overwrite)."""
        return self.captured / f"capture-{data_offset:012d}"

    def capture_chunks(self) -> list[tuple[int, Path]]:
        """(data offset, file) of every chunk file, in data order."""
        found = []
        for path in self.captured.glob("capture-*.safetensors*") if self.captured.is_dir() else ():
            try:
                found.append((int(path.name.split(".")[0].removeprefix("capture-")), path))
            except ValueError:
                continue
        return sorted(found)


@dataclass(frozen=True)
class RunLayout:
    out: Path

    # ---- the run's own ---------------------------------------------------------------------
    @property
    def lock(self) -> Path:
        return self.out / ".lock"

    @property
    def engine_log(self) -> Path:
        """A detached engine's output."""
        return self.out / "engine.log"

    @property
    def target_profile(self) -> Path:
        return self.out / "target-profile.json"

    @property
    def servers(self) -> Path:
        return self.out / "servers"

    def server_log(self, name: str) -> Path:
        return self.servers / f"{name}.log"

    @property
    def capture_extension(self) -> Path:
        """Where extract puts the capture hook vLLM's workers import."""
        return self.servers / "ext"

    # ---- generate ----------------------------------------------------------------------------
    def dataset(self, name: str) -> DatasetFiles:
        return DatasetFiles(self.out / name)

    # ---- prepare -----------------------------------------------------------------------------
    @property
    def prepared(self) -> Path:
        return self.out / "prepared"

    @property
    def prepared_index(self) -> Path:
        return self.prepared / INDEX

    @property
    def draft_vocab(self) -> Path:
        return self.prepared / DRAFT_VOCAB

    @property
    def held_out(self) -> Path:
        """The prompts eval asks, held out of training."""
        return self.prepared / "eval.jsonl"

    # ---- extract -----------------------------------------------------------------------------
    @property
    def features(self) -> Path:
        return self.out / "features"

    @property
    def features_index(self) -> Path:
        return self.features / INDEX

    # ---- train -------------------------------------------------------------------------------
    @property
    def train(self) -> Path:
        return self.out / "train"

    @property
    def checkpoint(self) -> Path:
        return self.train / "checkpoint.pt"

    @property
    def history(self) -> Path:
        return self.train / "history.jsonl"

    # ---- export and eval ---------------------------------------------------------------------
    @property
    def export(self) -> Path:
        return self.out / "drafter"

    @property
    def exported_config(self) -> Path:
        return self.export / "config.json"

    @property
    def exported_weights(self) -> Path:
        return self.export / "model.safetensors"

    @property
    def speculators(self) -> Path:
        return self.out / "drafter-speculators"

    @property
    def eval_result(self) -> Path:
        return self.out / "eval.json"

    @property
    def eval_benchmarks(self) -> Path:
        return self.export / "eval_benchmarks.json"
