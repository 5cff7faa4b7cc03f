"""One pass (``[extract] during_generate``): the served target keeps the hidden states of every
request it answers for generate, and each saved batch of records takes its rows with it.

The vLLM eagleops serves for generate runs our capture extension (``servers.vllm_capture``) in
request mode. Every request sent to it carries a capture mark (``X-Request-Id``); when the store
saves a batch, ``ServedCapture.take`` asks the workers to write the rows of the batch's replies
to one chunk, ``OUT/<dataset>/captured/capture-<offset>``, named by where the batch's records
start in data.jsonl, and only then are the records appended. The records are the commit: a kill
between the two leaves a chunk at or past the end of data.jsonl, which the store removes when it
opens (and the batch, made again, would write the same name). A reply's rows are the sequence
the server processed, its prompt ids then its completion ids, but the last completion id (never
fed back); extract finds them by those ids, so a chunk says for itself which sample it serves.

Torch-free: generate never imports torch; the workers write the safetensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleops.pipeline.errors import RunError

__all__ = [
    "CapturePlan", "CaptureRef", "ServedCapture", "capture_refs", "new_mark", "remove_orphan_chunks", "sequence_digest", "take_batch",
]  # fmt: skip


@dataclass(frozen=True)
class CapturePlan:
    """What the serving target captures (extract's layers, in our numbering), and whether it is
    multimodal: served then as its language model only, so that its forwards get token ids."""

    layers: tuple[int, ...]
    multimodal: bool = False


def new_mark() -> str:
    """A request's capture mark (its X-Request-Id): what the workers keep its rows under."""
    return f"eagleops-{secrets.token_hex(12)}"


def sequence_digest(ids: Sequence[int]) -> str:
    """The digest the workers give of a reply's rows' token ids (int32, native order)."""
    return hashlib.blake2b(array("i", ids).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class CaptureRef:
    """One reply the served target captured: its mark and the sequence it processed."""

    mark: str
    ids: tuple[int, ...]  # prompt ids then completion ids
    kept: bool = True  # False: the next reply's rows hold these; the workers only forget them

    @property
    def rows(self) -> int:
        return len(self.ids) - 1  # the last id was generated, never fed back: no state


def capture_refs(
    marks: Sequence[str | None], prompts: Sequence[Sequence[int] | None], replies: Sequence[Sequence[int] | None]
) -> list[CaptureRef]:
    """The replies of one record the serving target captured, each with its mark and both id
    lists; one whose rows the next reply's prompt holds again is not ``kept`` (a chat whose next
    prompt continues the reply: prepare trains the two in one sample, whose rows the later
    request has), so the workers drop its rows at once instead of keeping them."""
    refs = [
        CaptureRef(mark, (*prompt, *reply))
        for mark, prompt, reply in zip(marks, prompts, replies, strict=True)
        if mark and prompt and reply
    ]
    later = [*refs[1:], None]
    return [
        ref if after is None or after.ids[: ref.rows] != ref.ids[: ref.rows] else dataclasses.replace(ref, kept=False)
        for ref, after in zip(refs, later, strict=False)
    ]


@dataclass
class TakeReport:
    rows: dict[str, int]  # mark -> rows written
    missing: dict[str, str]  # mark -> why none were written
    restarted: bool = False  # the server had no capture running (restarted): it runs again now
    bytes: int = 0  # the chunk's size on disk


class ServedCapture:
    """The capture running in the vLLM generate serves: started once (and again after the
    server restarts), then a batch's rows taken per save. Blocking: call in a thread."""

    def __init__(
        self,
        base_url: str,
        log_path: Path,
        layers: Sequence[int],
        *,
        on_problem: Callable[[str], object] = lambda message: None,
        rpc: Callable[..., list[Any]] | None = None,
    ):
        from eagleops.pipeline.servers.vllm import collective_rpc

        self.base_url, self.log_path, self.layers = base_url, log_path, tuple(layers)
        self.on_problem = on_problem  # a batch whose rows were not all captured, in words (called from the saving thread)
        self._rpc = rpc or collective_rpc
        # extract.max_cache_gb: captures stop there (extract computes the rest); set by the stage
        self.limit_bytes, self.taken_bytes = 0, 0

    def start(self) -> None:
        self._rpc(self.base_url, self.log_path, "eagleops_capture_requests", json.dumps(list(self.layers)))

    def take(self, stem: Path, refs: Sequence[CaptureRef], forget: Sequence[str] = ()) -> TakeReport:
        """Write ``refs``' rows to ``stem``'s chunk (every rank's file); which were written. A
        reply whose rows are not the ids it says (a capture that gave rows to the wrong request)
        fails the whole chunk: it is removed, and extract captures those records itself."""
        stem.parent.mkdir(parents=True, exist_ok=True)
        if self.limit_bytes and self.taken_bytes >= self.limit_bytes:  # full: the workers only forget
            body = json.dumps({"take": [], "forget": [*forget, *(ref.mark for ref in refs)]})
            self._rpc(self.base_url, self.log_path, "eagleops_capture_take", str(stem), body)
            if self.taken_bytes < self.limit_bytes + 1:
                self.taken_bytes = self.limit_bytes + 1  # said once
                self.on_problem(
                    f"captured {self.limit_bytes / 1e9:g} GB while generating (extract.max_cache_gb): extract captures the replies from here on"
                )
            return TakeReport({}, {})
        body = json.dumps({"take": [[ref.mark, ref.rows] for ref in refs], "forget": list(forget)})
        reports = [json.loads(r) for r in self._rpc(self.base_url, self.log_path, "eagleops_capture_take", str(stem), body)]
        mine = [r for r in reports if r.get("capturing")]
        if not mine:  # a restarted server: capture again from now on; this batch's rows are gone
            self.start()
            return TakeReport({}, {ref.mark: "the server restarted" for ref in refs}, restarted=True)
        written, missing = mine[0]["written"], dict(mine[0]["missing"])
        wrong = [ref.mark for ref in refs if ref.mark in written and written[ref.mark] != sequence_digest(ref.ids[:-1])]
        if wrong:
            for path in stem.parent.glob(stem.name + ".*"):
                path.unlink(missing_ok=True)
            raise RunError(
                f"vLLM's capture gave {len(wrong)} replies rows of other tokens; chunk {stem.name} removed (a capture bug: please report)"
            )
        size = sum(path.stat().st_size for path in stem.parent.glob(stem.name + ".rank*.safetensors"))
        self.taken_bytes += size
        return TakeReport({ref.mark: ref.rows for ref in refs if ref.mark in written}, missing, bytes=size)


Entry = tuple[int, bytes, dict[str, Any], tuple[CaptureRef, ...]]  # a store's record: source offset, line, record, captures


def take_batch(
    capture: Any, stem: Path, dataset: str, entries: Sequence[Entry], size: int
) -> tuple[list[tuple[int, bytes, dict[str, Any]]], int]:
    """A batch's records, each with ``captured_rows`` where its replies' rows were written to
    ``stem``'s chunk, and the chunks' bytes on disk after it (``size`` before). What was not
    captured is said through ``capture.on_problem``; its records land all the same (extract
    captures them), and a take that fails fails no save."""
    refs = [ref for entry in entries for ref in entry[3] if ref.kept]
    try:
        report = capture.take(stem, refs, [ref.mark for entry in entries for ref in entry[3] if not ref.kept])
        size += report.bytes
    except (RunError, OSError) as exc:
        capture.on_problem(f"{dataset}: hidden states of {len(refs)} replies not captured ({exc}); extract captures them")
        return [(offset, line, record) for offset, line, record, _ in entries], size
    if report.missing:
        first = next(iter(report.missing.values()))
        capture.on_problem(
            f"{dataset}: {len(report.missing)} of {len(refs)} replies' hidden states not captured ({first}); extract captures them"
        )
    landed = []
    for offset, line, record, captures in entries:
        rows = sum(report.rows.get(ref.mark, 0) for ref in captures)
        landed.append((offset, line, {**record, "captured_rows": rows} if rows else record))
    return landed, size


def remove_orphan_chunks(files: Any, data_size: int) -> int:
    """Remove the chunks whose records never landed (a kill between the two: at or past the end
    of data.jsonl) and half-written ones; the bytes of the chunks kept."""
    kept = 0
    for offset, path in files.capture_chunks():
        if offset >= data_size or path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
        else:
            kept += path.stat().st_size
    return kept
