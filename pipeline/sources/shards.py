"""Where a dataset's rows are: the shard files behind a source path, and a reader per file kind
that starts at a position in O(1) of what came before (or says where it cannot).

A source is one file, a glob, a folder of shards, a folder ``datasets.save_to_disk`` wrote (one
split, or a ``DatasetDict`` of several) or a hub-cache dataset folder. Its shards are read in
order; a **position** is one integer, ``shard << 44 | within``, where ``within`` is a byte offset
(JSONL, JSON arrays), a byte offset into the decompressed text (``.gz``, ``.zst``) or a row
index (Parquet, Arrow). One shard's positions are exactly the byte offsets the JSONL reader
always used, so an older single-file run resumes unchanged.

Each kind's reader, and what its resume costs, is in ``readers``.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

from eagleops.pipeline.errors import InputError
from eagleops.pipeline.sources.readers import RawRow, Shard, read_shard, sniffed

__all__ = ["SHARD_BITS", "RawRow", "Shard", "Source", "find_shards", "position", "split_position"]

SHARD_BITS = 44  # 16 TiB of one shard's bytes or rows; 2**19 shards
_WITHIN = (1 << SHARD_BITS) - 1
_FINGERPRINT_SPAN = 4096
_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_COMPRESSED = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
_METADATA = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}  # the datasets library's, not rows
_SKIPPED_DIRS = {".git", ".cache", ".huggingface", "__pycache__"}


def position(shard: int, within: int) -> int:
    return shard << SHARD_BITS | within


def split_position(pos: int) -> tuple[int, int]:
    return pos >> SHARD_BITS, pos & _WITHIN


def _kind(path: Path) -> tuple[str, str | None] | None:
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = _COMPRESSED.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = _KINDS.get(suffixes[-1]) if suffixes else None
    return (kind, compression) if kind else None


def _natural(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _split_of(relative: Path) -> str | None:
    """The split a hub file belongs to: ``data/train_sft-00000-of-00003.parquet`` (the hub's own
    shard names), ``train/0000.parquet``, ``test.jsonl``."""
    named = re.match(r"^(.+?)-\d{5}-of-\d{5}", relative.name)
    if named:
        return named.group(1)
    for part in relative.parts[:-1]:
        if part.lower() in _SPLITS:
            return part.lower()
    stem = relative.name.split(".")[0].lower()
    return stem if stem in _SPLITS else None


def _choose_split(found: list[str], wanted: str | None, where: Path) -> str | None:
    if wanted is not None:
        if wanted not in found:
            raise InputError(f"{where}: no split {wanted!r} (it has {', '.join(sorted(found)) or 'none'})")
        return wanted
    if len(found) <= 1:
        return found[0] if found else None
    if "train" in found:
        return "train"
    raise InputError(f"{where}: several splits ({', '.join(sorted(found))}); choose one with `split`")


def _snapshot(folder: Path) -> Path:
    """A hub-cache repo folder (``datasets--org--name``): the snapshot ``refs/main`` names."""
    snapshots = folder / "snapshots"
    ref = folder / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not found:
        raise InputError(f"{folder}: a hub-cache folder with no snapshot")
    return found[-1]


def _saved_dataset(folder: Path, split: str | None) -> list[Path]:
    """A folder ``datasets.save_to_disk`` wrote: its ``state.json`` lists the Arrow files in order."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        chosen = _choose_split(list(splits), split, folder)
        return _saved_dataset(folder / str(chosen), None)
    state = json.loads((folder / "state.json").read_text())
    try:
        return [folder / entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise InputError(f"{folder / 'state.json'}: _data_files: missing or not a list of {{filename}}") from None


def _folder(folder: Path, split: str | None) -> list[Path]:
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return _saved_dataset(folder, split)
    if folder.name.startswith("datasets--") and (folder / "snapshots").is_dir():
        folder = _snapshot(folder)
    files = []
    for root, dirs, names in os.walk(folder, followlinks=True):  # a hub snapshot's files are links into blobs/
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        files += [Path(root) / n for n in names if _kind(Path(n)) is not None and not n.startswith(".") and n not in _METADATA]
    if not files:
        raise InputError(f"{folder}: no data files (.jsonl, .json, .parquet, .arrow, compressed .gz/.zst) in this folder")
    by_split: dict[str | None, list[Path]] = {}
    for file in files:
        by_split.setdefault(_split_of(file.relative_to(folder)), []).append(file)
    named = [s for s in by_split if s is not None]
    if split is None and None in by_split:  # not a folder of splits (some files name none): every file
        return files
    chosen = _choose_split(named, split, folder)
    return by_split.get(chosen, [])


def find_shards(path: Path, split: str | None = None) -> list[Shard]:
    """The shard files of a source, in reading order. Raises InputError naming the path."""
    text = str(path)
    if glob.has_magic(text):
        paths = [Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file()]
        if not paths:
            raise InputError(f"{path}: no file matches")
    elif path.is_dir():
        paths = _folder(path, split)
    elif path.exists():
        paths = [path]
    else:
        raise InputError(f"{path}: no such file or folder")
    shards = []
    for p in sorted(paths, key=_natural):
        kind, compression = _kind(p) or ("jsonl", None)  # a single file of another name: JSONL, as always
        shards.append(sniffed(Shard(p, kind, compression)))
    return shards


class Source:
    """A source path's shards (found on first use) and what a resume checks against."""

    def __init__(self, path: Path, split: str | None = None):
        self.path, self.split = Path(path), split

    @cached_property
    def shards(self) -> list[Shard]:
        return find_shards(self.path, self.split)

    def __str__(self) -> str:
        return str(self.path)

    def exists(self) -> bool:
        try:
            return bool(self.shards)
        except (InputError, OSError):
            return False

    def is_single_jsonl(self) -> bool:
        return len(self.shards) == 1 and self.shards[0].kind == "jsonl" and self.shards[0].compression is None

    def seekable_size(self) -> int:
        """The bytes a position runs through when it is a byte offset (one plain JSONL file), else 0."""
        return self.shards[0].path.stat().st_size if self.is_single_jsonl() else 0

    def label(self, shard: int) -> str:
        """How records and errors name a shard: its path relative to the source folder."""
        path = self.shards[shard].path
        if glob.has_magic(str(self.path)):  # the folder the pattern starts from: `data/**/*.jsonl` -> data
            base = Path(*[part for part in itertools.takewhile(lambda p: not glob.has_magic(p), self.path.parts)])
        else:
            base = self.path if self.path.is_dir() else self.path.parent
        try:
            return str(path.relative_to(base))
        except ValueError:
            return str(path)

    def resume_problem(self, pos: int) -> str | None:
        """Why a run cannot resume at ``pos`` (None: it can)."""
        shard, within = split_position(pos)
        if shard >= len(self.shards):
            return f"{self.path}: has {len(self.shards)} shards, the run was in shard {shard + 1}"
        if self.shards[shard].kind in ("jsonl", "json") and self.shards[shard].compression is None:
            if self.shards[shard].path.stat().st_size < within:
                return f"{self.shards[shard].path}: shorter than the resume point (byte {within})"
        return None

    def fingerprint(self, pos: int) -> str:
        """O(1) evidence that the source is the one a run was writing from: for one JSONL file
        the bytes around the resume point (as always); for shards, each earlier shard's name and
        size and the current one's head."""
        shard, within = split_position(pos)
        if self.is_single_jsonl():
            return _bytes_fingerprint(self.shards[0].path, within)
        h = hashlib.blake2b(digest_size=12)
        for i, item in enumerate(self.shards[: shard + 1]):
            h.update(f"{self.label(i)}\0{item.path.stat().st_size}\0".encode())
        if shard < len(self.shards):
            with open(self.shards[shard].path, "rb") as f:
                h.update(f.read(_FINGERPRINT_SPAN))
        return h.hexdigest()

    def rows(self, start: int = 0) -> Iterator[tuple[int, RawRow]]:
        """(shard index, row) from position ``start`` on, across shards."""
        first, within = split_position(start)
        for index in range(first, len(self.shards)):
            yield from ((index, row) for row in read_shard(self.shards[index], within if index == first else 0))


def _bytes_fingerprint(path: Path, offset: int) -> str:
    """Hash of the file's head and of the bytes just before ``offset``."""
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        h.update(f.read(min(offset, _FINGERPRINT_SPAN)))
        if offset > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, offset - _FINGERPRINT_SPAN))
            h.update(f.read(offset - f.tell()))
    return h.hexdigest()
