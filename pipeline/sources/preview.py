"""``eagleops sources RUN.toml``: each dataset's shards and first rows exactly as generate will
read them (the same reader, the same field map), so a map that does not fit is seen before any
request is sent: the conversations it makes, the tools it finds, the rows it refuses and why."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from eagleops.pipeline.config import DatasetConfig, RunConfig
from eagleops.pipeline.config.fields import field_map
from eagleops.pipeline.errors import InputError, UsageError
from eagleops.pipeline.sources.reader import BadLine, Prompt, SourceReader
from eagleops.pipeline.sources.shards import Shard, Source

__all__ = ["SourcePreview", "preview_sources", "render_preview"]


@dataclass
class SourcePreview:
    dataset: str
    path: str
    format: str
    fields: dict[str, Any]
    shards: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _shard_facts(source: Source, index: int, shard: Shard) -> dict[str, Any]:
    facts: dict[str, Any] = {"file": source.label(index), "kind": shard.kind + (f".{shard.compression}" if shard.compression else "")}
    facts["bytes"] = shard.path.stat().st_size
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(shard.path).metadata
        facts.update(rows=meta.num_rows, row_groups=meta.num_row_groups, columns=meta.schema.names)
    return facts


def _preview(ds: DatasetConfig, rows: int, regenerate: str) -> SourcePreview:
    fields = field_map(ds.format, ds.fields, ds.id_field)
    shown = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(fields).items() if v}
    found = SourcePreview(ds.name, str(ds.path), ds.format, shown)
    source = Source(ds.path, ds.split)
    try:
        found.shards = [_shard_facts(source, i, shard) for i, shard in enumerate(source.shards)]
        for item in SourceReader(source, fields, regenerate=regenerate):
            if isinstance(item, BadLine):
                found.bad.append(item.message)
            elif isinstance(item, Prompt):
                found.rows.append({"id": item.prompt_id, "where": f"{item.shard or ds.path.name}:{item.line}", "messages": list(item.messages),
                                   "tools": [t["function"]["name"] for t in item.tools or ()]})  # fmt: skip
            if len(found.rows) + len(found.bad) >= rows:
                break
    except (InputError, OSError) as exc:
        found.error = str(exc)
    return found


def preview_sources(config: RunConfig, rows: int = 3, datasets: Collection[str] | None = None) -> list[SourcePreview]:
    names = [ds.name for ds in config.datasets]
    unknown = [d for d in datasets or () if d not in names]
    if unknown:
        raise UsageError(f"{config.source}: no dataset {', '.join(unknown)} (the run file has {', '.join(names)})")
    return [_preview(ds, rows, ds.regenerate) for ds in config.datasets if not datasets or ds.name in datasets]


def _clip(text: str, width: int) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def render_preview(previews: list[SourcePreview], width: int = 80) -> str:
    out: list[str] = []
    for p in previews:
        out.append(f"== {p.dataset} (format {p.format})")
        out.append(f"   path: {p.path}")
        fields = ", ".join(f"{k}={'|'.join(v) if isinstance(v, list) else v}" for k, v in p.fields.items())
        out += textwrap.wrap(fields, width, initial_indent="   fields: ", subsequent_indent="           ")
        for shard in p.shards[:5]:
            extra = f", {shard['rows']} rows in {shard['row_groups']} row groups" if "rows" in shard else ""
            out.append(f"   shard {shard['file']} ({shard['kind']}, {shard['bytes']:,} bytes{extra})")
        if len(p.shards) > 5:
            out.append(f"   ... {len(p.shards) - 5} more shards ({len(p.shards)} in all)")
        if p.error:
            out.append(f"   ERROR {p.error}")
        for row in p.rows:
            tools = f" tools: {', '.join(row['tools'])}" if row["tools"] else ""
            out.append(f"   {row['where']} id {row['id']}{tools}")
            for m in row["messages"]:
                calls = f" [calls {', '.join(c['function']['name'] for c in m['tool_calls'])}]" if m.get("tool_calls") else ""
                out.append(f"     {m['role']:>9}: {_clip(m['content'], width - 17)}{calls}")
        for bad in p.bad:
            out.append(f"   BAD {bad}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def preview_json(previews: list[SourcePreview]) -> str:
    return json.dumps([p.to_json() for p in previews], ensure_ascii=False, indent=1)
