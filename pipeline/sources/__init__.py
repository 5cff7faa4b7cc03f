"""Prompt sources: the files behind a dataset path (``shards``), a row read through a field map
(``rows``), rows as prompts from a resumable position (``reader``), and a look at the first rows
as eagleops reads them (``preview``). Files only: generate and eval both read through here."""

from eagleops.pipeline.sources.reader import BadLine, Prompt, SourceReader
from eagleops.pipeline.sources.rows import RowError, prompt_id_for, read_row, reply_points
from eagleops.pipeline.sources.shards import Source, find_shards

__all__ = ["BadLine", "Prompt", "RowError", "Source", "SourceReader", "find_shards", "prompt_id_for", "read_row", "reply_points"]
