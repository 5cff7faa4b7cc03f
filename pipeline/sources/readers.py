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

import codecs
import gzip
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from eagleops.pipeline.errors import InputError

__all__ = ["RawRow", "Shard", "read_shard", "sniffed"]


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


def sniffed(shard: Shard) -> Shard:
    """A ``.json`` file that is JSONL (one object a line, as many datasets name it) reads as JSONL."""
    if shard.kind != "json":
        return shard
    with _open_text_bytes(shard) as stream:
        head = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return shard if head.startswith(b"[") or not head else Shard(shard.path, "jsonl", shard.compression)


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
            except json.JSONDecodeError as exc:  # Python's own message, with where: the line is the row's
                yield RawRow(here, offset, number, None, f"invalid JSON: {exc.msg} (column {exc.colno})")
            except UnicodeDecodeError as exc:
                yield RawRow(here, offset, number, None, f"not UTF-8: {exc.reason} (byte {here + exc.start:,} of the file)")


_SEPARATORS = re.compile(r"[\s,]*")
_ITEM_LIMIT = 64 << 20  # characters one array item may take before a parse error is final


class _Window:
    """A JSON array's text read in chunks: a str with a cursor (no copy per item), the byte
    offset of the cursor, and an incremental UTF-8 decoder (a character split across two chunks
    is whole; an invalid byte is an error where it stands)."""

    def __init__(self, stream: BinaryIO, offset: int):
        self.stream, self.offset = stream, offset
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.text, self.cursor, self.eof = "", 0, False

    def fill(self) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(1 << 20)
        self.eof = not chunk
        if self.cursor > len(self.text) // 2:  # drop what was read, now and then, not per item
            self.text, self.cursor = self.text[self.cursor :], 0
        self.text += self.decoder.decode(chunk, final=self.eof)
        return bool(chunk)

    def advance(self, end: int) -> None:
        self.offset += len(self.text[self.cursor : end].encode("utf-8"))
        self.cursor = end

    def skip_separators(self) -> None:
        while True:
            self.advance(_SEPARATORS.match(self.text, self.cursor).end())  # type: ignore[union-attr]
            if self.cursor < len(self.text) or not self.fill():
                return


def _json_array_rows(shard: Shard, within: int) -> Iterator[RawRow]:
    """The items of a top-level JSON array, one at a time in bounded memory (the window holds
    the item being read, not the file), so a resume seeks to an item's first byte. ``within`` 0
    is the start of the file (the ``[`` is skipped); else the first byte of an item. A file
    that stops being valid JSON ends with a row naming where: nothing after it can be trusted."""
    decoder = json.JSONDecoder()
    with _open_text_bytes(shard) as stream:
        _skip(stream, within, shard)
        window, number = _Window(stream, within), 0
        try:
            window.fill()
            if within == 0:
                window.advance(len(window.text) - len(window.text.lstrip("\ufeff \t\r\n")))
                if not window.text.startswith("[", window.cursor):
                    yield RawRow(
                        0, window.offset, 1, None, "not a JSON array (a `.json` source is `[{...}, {...}]`, or JSONL: one object a line)"
                    )
                    return
                window.advance(window.cursor + 1)
            while True:
                window.skip_separators()
                if window.cursor >= len(window.text) or window.text.startswith("]", window.cursor):
                    return
                number += 1
                while True:
                    try:
                        value, end = decoder.raw_decode(window.text, window.cursor)
                    except json.JSONDecodeError as exc:
                        at = window.offset + len(window.text[window.cursor : exc.pos].encode("utf-8"))  # before a fill moves the text
                        if len(window.text) - window.cursor < _ITEM_LIMIT and window.fill():
                            continue  # an item cut at the window's edge (or bad): read on, up to the limit
                        yield RawRow(
                            window.offset, window.offset + 1, number, None,
                            f"invalid JSON: {exc.msg} (byte {at:,} of the file); the rest of the file is not read",
                        )  # fmt: skip
                        return
                    if end == len(window.text) and window.fill():
                        continue  # a number or literal cut at the window's edge may go on
                    start = window.offset
                    window.advance(end)
                    yield RawRow(start, window.offset, number, value)
                    break
        except UnicodeDecodeError as exc:
            yield RawRow(window.offset, window.offset + 1, number or 1, None, f"not UTF-8 ({exc.reason}); the rest of the file is not read")


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
