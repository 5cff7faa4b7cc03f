"""A reader per shard kind, each starting at a position within the shard in O(1) of what came
before it, or saying where it cannot:

* JSONL and JSON arrays seek to the byte (a JSON array is decoded item by item from a window,
  so an item of any size is read in bounded memory);
* Parquet reads from the row group that holds the row (its footer says which);
* Arrow (``datasets.save_to_disk`` writes IPC streams) is memory-mapped, and the record batches
  before the row are passed over without being copied;
* compressed JSONL (``.gz``, ``.zst``) must decompress what it skips: neither format has an
  index to seek by, so its resume costs a decompression of the prefix (no parse).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.errors import InputError

__all__ = ["RawRow", "Shard", "read_shard"]


@dataclass(frozen=True, slots=True)
class Shard:
    path: Path
    kind: str  # jsonl, json, parquet, arrow
    compression: str | None  # gz, zst

    @property
    def numbers_from_resume(self) -> bool:
        """Whether its reader counts lines (items) from the resume point, not the file's start."""
        return self.kind in ("jsonl", "json")

    @property
    def unit(self) -> str:
        """What a BadLine's number counts: ``line`` for JSONL, ``row`` otherwise."""
        return "line" if self.kind == "jsonl" else "row"


@dataclass(frozen=True, slots=True)
class RawRow:
    """One row of a shard as the reader found it: ``value`` (the decoded object) or ``error``."""

    within: int
    end: int
    number: int  # 1-based line (JSONL) or row in the shard
    value: Any
    error: str | None = None


def read_shard(shard: Shard, within: int) -> Iterator[RawRow]:
    if shard.kind == "parquet":
        return _parquet_rows(shard.path, within)
    if shard.kind == "arrow":
        return _arrow_rows(shard.path, within)
    if shard.kind == "json":
        return _json_array_rows(shard, within)
    return _jsonl_rows(shard, within)


def _open_text_bytes(shard: Shard) -> BinaryIO:
    """The shard's (decompressed) bytes, as a stream that can skip forward."""
    if shard.compression == "gz":
        return gzip.open(shard.path, "rb")  # type: ignore[return-value]
    raw = open(shard.path, "rb")
    if shard.compression == "zst":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return raw


def _skip(stream: BinaryIO, count: int, shard: Shard) -> None:
    if not shard.compression:
        stream.seek(count)
        return
    while count:
        chunk = stream.read(min(count, 1 << 20))
        if not chunk:
            raise InputError(f"{shard.path}: shorter than the resume point (byte {count} of decompressed text left)")
        count -= len(chunk)


def _jsonl_rows(shard: Shard, within: int) -> Iterator[RawRow]:
    """JSONL from byte ``within``; the line numbers count from there (the caller adds the lines before)."""
    with _open_text_bytes(shard) as stream:
        _skip(stream, within, shard)
        offset, number = within, 0
        for raw in stream:
            number += 1
            here, offset = offset, offset + len(raw)
            text = raw.strip()
            if not text:
                continue  # blank lines carry nothing; the next row's end moves past them
            try:
                yield RawRow(here, offset, number, json.loads(text))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield RawRow(here, offset, number, None, f"invalid JSON ({getattr(exc, 'msg', exc)})")


def _json_array_rows(shard: Shard, within: int) -> Iterator[RawRow]:
    """The items of a top-level JSON array, one at a time in bounded memory: each is decoded
    from a window of the file, so a resume seeks to its first byte. ``within`` 0 is the start
    of the file (the ``[`` is skipped); else the first byte of an item."""
    decoder = json.JSONDecoder()
    with _open_text_bytes(shard) as stream:
        _skip(stream, within, shard)
        buffer, offset, number, eof = b"", within, 0, False

        def fill() -> bool:
            nonlocal buffer, eof
            chunk = stream.read(1 << 20)
            eof = not chunk
            buffer += chunk
            return bool(chunk)

        def skip_separators(opening: bool) -> None:
            nonlocal buffer, offset
            while True:
                stripped = buffer.lstrip(b" \t\r\n," if not opening else b" \t\r\n\xef\xbb\xbf")
                offset += len(buffer) - len(stripped)
                buffer = stripped
                if buffer or not fill():
                    return

        if within == 0:
            skip_separators(True)
            if not buffer.startswith(b"["):
                yield RawRow(
                    0, offset, 1, None, "not a JSON array (a `.json` source is `[{...}, {...}]`; use .jsonl for one object a line)"
                )
                return
            buffer, offset = buffer[1:], offset + 1
        while True:
            skip_separators(False)
            if not buffer or buffer.startswith(b"]"):
                return
            number += 1
            while True:
                try:
                    text = buffer.decode("utf-8", errors="strict")
                except UnicodeDecodeError as exc:
                    text = buffer[: exc.start].decode("utf-8") if not eof and exc.start > len(buffer) - 4 else None  # type: ignore[assignment]
                    if text is None:
                        yield RawRow(offset, offset + len(buffer), number, None, f"not UTF-8 at byte {offset + exc.start}")
                        return
                try:
                    value, end = decoder.raw_decode(text)
                except json.JSONDecodeError as exc:
                    if not eof and fill():
                        continue
                    yield RawRow(offset, offset + len(buffer), number, None, f"invalid JSON ({exc.msg})")
                    return
                if end == len(text) and not eof and fill():
                    continue  # a number or literal cut at the window's edge may go on
                size = len(text[:end].encode("utf-8"))
                yield RawRow(offset, offset + size, number, value)
                buffer, offset = buffer[size:], offset + size
                break


def _parquet_rows(path: Path, within: int) -> Iterator[RawRow]:
    """From row ``within``: the row group that holds it is found in the footer, read from there."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        meta = file.metadata
        group, first = 0, 0
        while group < meta.num_row_groups and first + meta.row_group(group).num_rows <= within:
            first += meta.row_group(group).num_rows
            group += 1
        if group >= meta.num_row_groups:
            return
        row = first
        for batch in file.iter_batches(batch_size=64, row_groups=range(group, meta.num_row_groups), use_threads=False):
            values = batch.to_pylist()
            for value in values:
                if row >= within:
                    yield RawRow(row, row + 1, row + 1, value)
                row += 1


def _arrow_rows(path: Path, within: int) -> Iterator[RawRow]:
    """An Arrow IPC file or stream (``datasets`` writes streams), memory-mapped: batches before
    the resume row are passed over without being copied."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader: Any = pa.ipc.open_file(source)
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        row = 0
        for batch in batches:
            if row + batch.num_rows <= within:
                row += batch.num_rows
                continue
            for start in range(0, batch.num_rows, 64):
                piece = batch.slice(start, 64)
                for value in piece.to_pylist():
                    if row >= within:
                        yield RawRow(row, row + 1, row + 1, value)
                    row += 1
