"""A source's rows as prompts: each shard read from a position (see ``shards``) through the
dataset's field map, yielding a Prompt per usable row and a BadLine per row that is not."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.config.fields import FieldMap, field_map
from eagleops.pipeline.sources.rows import RowError, read_row
from eagleops.pipeline.sources.shards import Source, position, split_position

__all__ = ["BadLine", "Prompt", "SourceReader"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request to make: the conversation up to (and including) its last user turn."""

    prompt_id: str
    messages: tuple[dict[str, Any], ...]
    offset: int  # the row's position in the source (``shards.position``)
    end: int  # the position just past it
    line: int  # 1-based line (JSONL) or row in its shard
    tools: tuple[dict[str, Any], ...] | None = None
    shard: str = ""  # the shard's name when the source has several, else ""


@dataclass(frozen=True, slots=True)
class BadLine:
    """A source row that cannot be used; ``message`` reads ``file:line: field: why``."""

    path: str
    line: int
    offset: int
    end: int
    field: str
    reason: str
    unit: str = "line"

    @property
    def message(self) -> str:
        where = f"{self.path}:{self.line}" if self.unit == "line" else f"{self.path}: row {self.line}"
        return f"{where}: {self.field}: {self.reason}"


class SourceReader:
    """Iterates a source from a position, yielding Prompt or BadLine. ``line``: the lines (rows)
    of the position's shard before it, so numbers stay those of the file."""

    def __init__(
        self,
        source: Source | Path,
        fields: FieldMap | str = "auto",
        id_field: str = "id",
        *,
        offset: int = 0,
        line: int = 0,
        regenerate: str = "last",
    ):
        self.source = source if isinstance(source, Source) else Source(source)
        self.fields = fields if isinstance(fields, FieldMap) else field_map(fields, None, id_field)
        self.regenerate = regenerate
        self.start_offset, self.start_line = offset, line

    def __iter__(self) -> Iterator[Prompt | BadLine]:
        shards = self.source.shards
        named = len(shards) > 1
        first_shard = split_position(self.start_offset)[0]
        for index, row in self.source.rows(self.start_offset):
            shard = shards[index]
            before = self.start_line if index == first_shard and shard.numbers_from_resume else 0
            number = row.number + before
            start, end = position(index, row.within), position(index, row.end)
            label = self.source.label(index) if named else str(shard.path)
            if row.error is not None:
                yield BadLine(label, number, start, end, "<json>", row.error, shard.unit)
                continue
            try:
                found = read_row(row.value, self.fields, self.regenerate)
            except RowError as exc:
                yield BadLine(label, number, start, end, exc.field, exc.reason, shard.unit)
                continue
            except Exception as exc:  # a row no check foresaw: still this row's failure, never the dataset's
                yield BadLine(label, number, start, end, "<row>", f"{type(exc).__name__}: {exc}", shard.unit)
                continue
            yield Prompt(found.prompt_id, found.messages, start, end, number, found.tools, self.source.label(index) if named else "")

    def batches(self, size: int = 256) -> Iterator[list[Prompt | BadLine]]:
        batch: list[Prompt | BadLine] = []
        for item in self:
            batch.append(item)
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch
