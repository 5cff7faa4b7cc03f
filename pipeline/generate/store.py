"""Crash-safe per-dataset output: append-only JSONL plus a small atomic progress manifest.

Layout of ``OUT/<dataset>/``:

* ``data.jsonl``   one regenerated conversation per line, appended in fsynced batches;
* ``failed.jsonl`` records that failed permanently and unusable source lines, with the reason;
* ``manifest.json`` written by temp-file + rename after every batch: the byte length of both
  files at that point, running totals, and a *watermark* into the source (the first source
  row that is not yet durably done) plus the source rows done beyond it;
* ``captured/`` with ``[extract] during_generate``: each batch's hidden states, taken from the
  serving target just before the batch's records are appended (``generate.capture``).

Done-ness is keyed by the row's position in the source (``sources.shards``: a JSONL line's
byte offset, a Parquet row's shard and index), not by the prompt's id: two rows that share an
id are two pieces of work, in a clean run and after any number of kills alike.

Every append starts at the committed length of its file: a write that failed half way (disk
full, too many open files) is cut off before the batch is written again, so no record ever
follows a partial line. A batch that could not be written stays in memory for the next try.

Resume reads the manifest, then only the bytes appended after it (at most one batch), repairs
a torn last line, and seeks the source to the watermark: its cost does not grow with the size
of the output or of the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.files import write_json_atomic
from eagleops.pipeline.generate.capture import CaptureRef, ServedCapture, remove_orphan_chunks, take_batch
from eagleops.pipeline.generate.limits import Budget
from eagleops.pipeline.layout import DatasetFiles
from eagleops.pipeline.sources import BadLine, Prompt, Source

__all__ = ["DatasetStore", "SaveRetry", "StoreError", "Totals", "WriteFailed"]

MANIFEST_VERSION = 2  # 1 keyed done work by prompt id; it is read and upgraded


class StoreError(RunError):
    """An output directory that does not match its manifest or its source."""


class WriteFailed(RunError):
    """Finished records could not be made durable (disk full, I/O error, no file descriptors).
    They are kept in memory and written again by the next flush."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(f"{path}: {error.strerror or error}")
        self.path, self.error = path, error


@dataclass
class Totals:
    samples: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    failures: int = 0
    bad_lines: int = 0
    truncated: int = 0
    skipped: int = 0  # rows not sent: too long to train a reply after
    cost: float = 0.0
    reasoning_tokens: int = 0  # of tokens: what the target spent thinking
    captured_rows: int = 0  # hidden-state rows the serving target captured (during_generate)

    def add_record(self, record: dict[str, Any]) -> None:
        self.samples += 1
        self.captured_rows += int(record.get("captured_rows") or 0)
        self.tokens += int(record.get("completion_tokens") or 0)
        self.reasoning_tokens += int(record.get("reasoning_tokens") or 0)
        self.prompt_tokens += int(record.get("prompt_tokens") or 0)
        self.truncated += record.get("finish_reason") == "length"
        self.cost += float(record.get("cost") or 0.0)

    def add_failure(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "bad_line":
            self.bad_lines += 1
        elif record.get("kind") == "skipped":
            self.skipped += 1
        else:
            self.failures += 1

    def copy(self) -> Totals:
        return Totals(**self.__dict__)


@dataclass
class SaveRetry:
    """Saves that failed in a row: the last one's reason, and when to try again (backoff)."""

    MAX_DELAY_S = 15.0
    error: str | None = None
    failures: int = 0
    retry_at: float = 0.0

    def failed(self, message: str, now: float) -> bool:
        """Counts a failure; True when its reason is new (worth a log line)."""
        self.failures += 1
        self.retry_at = now + min(self.MAX_DELAY_S, 0.25 * 2 ** min(self.failures, 16))  # (a float of 2**1024 overflows)
        new, self.error = message != self.error, message
        return new

    def reset(self) -> int:
        """A save succeeded (or nothing is left to save): the failures it ends."""
        failures, self.error, self.failures = self.failures, None, 0
        return failures

    def due(self, now: float) -> bool:
        return self.error is None or now >= self.retry_at


@dataclass
class _Batch:
    # source offset, line, record, the replies the serving target captured for it (not yet taken)
    data: list[tuple[int, bytes, dict[str, Any], tuple[CaptureRef, ...]]] = field(default_factory=list)
    failed: list[tuple[int, bytes, dict[str, Any]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.data or self.failed)

    def put_back(self, newer: _Batch) -> _Batch:
        """This batch (whose write failed) followed by what was added since: order kept."""
        return _Batch(self.data + newer.data, self.failed + newer.failed)


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


class DatasetStore:
    """Owned by the event loop; file I/O runs in worker threads, one flush at a time."""

    def __init__(
        self, directory: Path, name: str, source: Source | Path, budget: Budget | None = None, *, capture: ServedCapture | None = None
    ):
        self.directory = directory
        self.name = name
        self.source = source if isinstance(source, Source) else Source(source)
        self.capture = capture  # the serving target's, with during_generate
        self.captured_bytes = 0  # the chunks' size on disk
        files = self.files = DatasetFiles(directory)
        self.data_path, self.failed_path, self.manifest_path = files.data, files.failed, files.manifest
        self.durable = Totals()  # what is on disk and in the manifest
        self.accepted = Totals()  # durable + buffered: what the budget is checked against
        self.budget = budget or Budget(run_file=0)  # kept here only to make a live change durable
        self.done_beyond: set[int] = set()  # source offsets durably done, >= watermark
        self._pending: dict[int, int] = {}  # source offset in flight -> lines before it
        self._read_pos: tuple[int, int] = (0, 0)  # (offset, lines before) of the next unread line
        self._sizes: tuple[int, int] = (0, 0)
        self._batch = _Batch()
        self._flush_lock = asyncio.Lock()
        self._manifest_stale = False  # records written, manifest not (its write failed)
        self.repaired_bytes = 0
        self.recovered_records = 0

    # ---- opening / recovery -------------------------------------------------------------
    def open(self) -> None:
        """Blocking: call through ``asyncio.to_thread``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest: dict[str, Any] = {}
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_bytes())
            except (OSError, json.JSONDecodeError) as exc:
                raise StoreError(f"{self.manifest_path}: unreadable manifest ({exc}); move it aside to rebuild") from None
            if manifest.get("version") not in (1, MANIFEST_VERSION):
                raise StoreError(f"{self.manifest_path}: manifest version {manifest.get('version')!r} not supported")
        elif self.data_path.exists() and self.data_path.stat().st_size:
            raise StoreError(
                f"{self.data_path}: output exists without {self.manifest_path.name}; "
                "it was not written by this tool (or the manifest was removed): move it aside"
            )
        watermark = manifest.get("watermark", {"offset": 0, "lines": 0})
        self._read_pos = (int(watermark["offset"]), int(watermark["lines"]))
        if manifest and self._read_pos[0] > 0:
            if not self.source.exists():
                raise StoreError(f"{self.source}: source missing (the run was at position {self._read_pos[0]})")
            problem = self.source.resume_problem(self._read_pos[0])
            if problem is not None or self.source.fingerprint(self._read_pos[0]) != manifest.get("source_fingerprint"):
                raise StoreError(
                    f"{self.source}: changed since this output was written ({problem or f'resume point {self._read_pos[0]}'}); "
                    "restore it or use a new output_dir"
                )
        done = manifest.get("done_beyond", [])
        self.done_beyond = {int(v) for v in (done.values() if isinstance(done, dict) else done)}  # v1: {id: offset}
        self.durable = Totals(**manifest.get("totals", {}))
        self.budget.live = manifest.get("budget_override")
        committed = manifest.get("committed", {"data": 0, "failed": 0})
        data_size = self._recover(self.data_path, int(committed["data"]), is_failure=False)
        failed_size = self._recover(self.failed_path, int(committed["failed"]), is_failure=True)
        self._sizes = (data_size, failed_size)
        self.captured_bytes = remove_orphan_chunks(self.files, data_size)
        self.accepted = self.durable.copy()
        if self.recovered_records or self.repaired_bytes or manifest.get("version") != MANIFEST_VERSION:
            self._write_manifest(self._manifest())

    def _recover(self, path: Path, committed: int, *, is_failure: bool) -> int:
        """Account for records appended after the last manifest; truncate a torn tail."""
        if not path.exists():
            if committed:
                raise StoreError(f"{path}: missing, but the manifest says {committed} bytes were written")
            path.touch()
            return 0
        size = path.stat().st_size
        if size < committed:
            raise StoreError(f"{path}: {size} bytes, shorter than the {committed} the manifest recorded (truncated by hand?)")
        if size == committed:
            return size
        good = committed
        with open(path, "rb") as f:
            f.seek(committed)
            tail = f.read(size - committed)
        for raw in tail.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break
            try:
                record = json.loads(raw)
                offset = int(record["source_offset"])
            except (ValueError, KeyError, TypeError):
                break
            good += len(raw)
            self.recovered_records += 1
            self.done_beyond.add(offset)
            (self.durable.add_failure if is_failure else self.durable.add_record)(record)
        if good < size:
            self.repaired_bytes += size - good
            with open(path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        return good

    # ---- the run's view -------------------------------------------------------------------
    def reader_position(self) -> tuple[int, int]:
        return self._read_pos

    def skip(self, item: Prompt | BadLine) -> bool:
        return item.offset in self.done_beyond

    def advanced(self, offset: int, lines: int) -> None:
        """The reader has consumed the source up to (offset, lines)."""
        self._read_pos = (offset, lines)

    def dispatched(self, item: Prompt | BadLine) -> None:
        self._pending[item.offset] = item.line - 1

    def add_record(self, prompt: Prompt, record: dict[str, Any], captures: tuple[CaptureRef, ...] = ()) -> None:
        line = _encode(record)  # first: a record that cannot be encoded is not counted
        self.accepted.add_record(record)
        self._batch.data.append((prompt.offset, line, record, captures if self.capture is not None else ()))

    def add_failure(self, item: Prompt | BadLine, record: dict[str, Any]) -> None:
        line = _encode(record)
        self.accepted.add_failure(record)
        self._batch.failed.append((item.offset, line, record))

    def captured(self) -> dict[str, int]:
        """The hidden-state rows saved with this dataset's records, and their chunks' bytes."""
        return {"captured_rows": self.durable.captured_rows, "captured_bytes": self.captured_bytes}

    def buffered(self) -> int:
        return len(self._batch.data) + len(self._batch.failed)

    def unsaved(self) -> bool:
        return bool(self._batch) or self._manifest_stale

    def discard_unsaved(self) -> int:
        """Forget the finished records that could not be saved (a kill while the disk is full):
        their source lines are past the watermark, so they are made again, once, on resume."""
        dropped = self.buffered()
        self._batch = _Batch()
        self.accepted = self.durable.copy()
        return dropped

    def done_offset(self) -> int:
        """Every source byte before this one is done or in flight's past: how far the dataset has come."""
        return self._watermark()[0]

    def rewind_to_watermark(self) -> None:
        """Forget in-flight work (cancelled): the next reader starts at the oldest of it."""
        self._read_pos = self._watermark()
        self._pending.clear()

    def _watermark(self) -> tuple[int, int]:
        if self._pending:
            offset = min(self._pending)
            return offset, self._pending[offset]
        return self._read_pos

    # ---- durability -----------------------------------------------------------------------
    async def flush(self, *, force_manifest: bool = False) -> None:
        """Make the buffered records durable. Raises WriteFailed, with the batch kept for the
        next call and nothing left on disk past the last whole record."""
        async with self._flush_lock:
            batch, self._batch = self._batch, _Batch()
            if not batch and not force_manifest and not self._manifest_stale:
                return
            if batch:
                if self.capture is not None and any(entry[3] for entry in batch.data):
                    batch = await asyncio.to_thread(self._take_captures, batch, self.capture)
                try:
                    self._sizes = await asyncio.to_thread(self._append, batch)
                except OSError as exc:
                    self._batch = batch.put_back(self._batch)
                    raise WriteFailed(getattr(exc, "path", self.data_path), exc) from None
                for offset, _, record, _ in batch.data:
                    self._pending.pop(offset, None)
                    self.done_beyond.add(offset)
                    self.durable.add_record(record)
                for offset, _, record in batch.failed:
                    self._pending.pop(offset, None)
                    self.done_beyond.add(offset)
                    self.durable.add_failure(record)
                self._manifest_stale = True
            try:
                await asyncio.to_thread(self._write_manifest, self._manifest())
            except OSError as exc:
                self._manifest_stale = True  # retried by the next flush, even with no records to add
                raise WriteFailed(self.manifest_path, exc) from None  # the records are safe: resume reads them back
            self._manifest_stale = False

    def _take_captures(self, batch: _Batch, capture: ServedCapture) -> _Batch:
        """The batch with its replies' rows taken into the chunk its records start at (see
        ``generate.capture``); taken once: a batch written again asks for nothing more."""
        stem = self.files.capture_chunk(self._sizes[0])
        data, self.captured_bytes = take_batch(capture, stem, self.name, batch.data, self.captured_bytes)
        return _Batch(
            [(offset, _encode(record) if record.get("captured_rows") else line, record, ()) for offset, line, record in data], batch.failed
        )

    def _append(self, batch: _Batch) -> tuple[int, int]:
        sizes = list(self._sizes)
        for i, (path, lines) in enumerate(((self.data_path, [e[1] for e in batch.data]), (self.failed_path, [e[1] for e in batch.failed]))):
            if not lines:
                continue
            payload = b"".join(lines)
            _write_at(path, sizes[i], payload)
            sizes[i] += len(payload)
        return sizes[0], sizes[1]

    def _manifest(self) -> dict[str, Any]:
        offset, lines = self._watermark()
        self.done_beyond = {off for off in self.done_beyond if off >= offset}
        return {
            "version": MANIFEST_VERSION,
            "dataset": self.name,
            "source": str(self.source),
            "watermark": {"offset": offset, "lines": lines},
            "done_beyond": sorted(self.done_beyond),
            "committed": {"data": self._sizes[0], "failed": self._sizes[1]},
            "totals": dict(self.durable.__dict__),
            "budget_override": self.budget.live,
        }

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        offset = manifest["watermark"]["offset"]
        manifest["source_fingerprint"] = self.source.fingerprint(offset) if self.source.exists() else None
        write_json_atomic(self.manifest_path, manifest)


class _WriteError(OSError):
    """An OSError that names the file it happened on."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(error.errno, error.strerror)
        self.path = path


def _write_at(path: Path, committed: int, payload: bytes) -> None:
    """Write ``payload`` at byte ``committed`` of ``path``, cutting off whatever a failed
    earlier write left there; on failure, cut back to ``committed`` (best effort: resume
    repairs a torn tail too) and raise."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _WriteError(path, exc) from None
    try:
        os.ftruncate(fd, committed)
        view = memoryview(payload)
        position = committed
        while view:
            written = os.pwrite(fd, view, position)
            view, position = view[written:], position + written
        os.fsync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, committed)
        raise _WriteError(path, exc) from None
    finally:
        os.close(fd)
