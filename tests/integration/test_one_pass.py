"""One pass (``[extract] during_generate``) without a server: the worker's per-request rows, the
store's commit of a batch's captures, the rows a sample takes by its ids, and the claim the
design rests on, that a sample's last row is never trained. A real vLLM runs it all in
tests/e2e/test_one_pass.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.generate.capture import CaptureRef, TakeReport, capture_refs, sequence_digest
from eagleops.pipeline.generate.store import DatasetStore
from eagleops.pipeline.layout import DatasetFiles
from eagleops.pipeline.servers import vllm_capture
from eagleops.pipeline.sources import Prompt
from eagleops.pipeline.training.extract.generated import GeneratedRows, shard_from_generate
from eagleops.pipeline.training.train.loss import Eagle3Objective

from .test_decoding import _drafter

H = 4  # hidden size of the fake captures
LAYERS = (1, 2, 3)


# ---- the claim: a sample's last row is never trained ----------------------------------------------


def test_a_samples_last_row_changes_no_loss_and_no_gradient():
    """A capture has no state for a reply's last id (generated, never fed back), so its sample's
    last row is zero: the loss, the accuracies and every gradient are the same as with the row
    a separate extract computes."""
    drafter = _drafter(seed=3)
    generator = torch.Generator().manual_seed(4)
    objective = Eagle3Objective(drafter, torch.randn(50, 24, generator=generator), ttt_length=4, step_weight=0.8, head_chunk=16)
    b, t = 2, 30
    lengths = torch.tensor([30, 22])
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[0, 12:30] = 1
    loss_mask[1, 5:22] = 1  # both replies run to their sample's end, the last id trained
    batch = {
        "input_ids": torch.randint(0, 50, (b, t), generator=generator),
        "aux": torch.randn(b, t, 72, generator=generator),
        "final": torch.randn(b, t, 24, generator=generator),
        "loss_mask": loss_mask,
        "lengths": lengths,
    }
    results = []
    for zero_last in (False, True):
        case = {k: v.clone() for k, v in batch.items()}
        if zero_last:
            for row, n in enumerate(lengths.tolist()):
                case["aux"][row, n - 1] = 0
                case["final"][row, n - 1] = 0
        drafter.zero_grad()
        total, losses, accuracies = objective(case)
        total.backward()
        results.append(
            (total.detach(), losses, accuracies, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        )
    (total_a, losses_a, acc_a, grads_a), (total_b, losses_b, acc_b, grads_b) = results
    assert torch.equal(total_a, total_b)
    assert all(torch.equal(x, y) for x, y in zip(losses_a + acc_a, losses_b + acc_b, strict=True))
    assert grads_a and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


# ---- the worker: rows kept per request, by the runner's own batch ----------------------------------


class _FakeWorker:
    """What the extension's request mode sees of vLLM: a batch per forward, hooked tensors."""

    def __init__(self) -> None:
        self.captured: dict[str, list[torch.Tensor]] = {
            name: [] for name in ("1", vllm_capture.FINAL, vllm_capture.TOKENS, vllm_capture.POSITIONS)
        }
        self.requests = vllm_capture._Requests(self.captured, [])

    def forward(self, batch: list[tuple[str, list[int], list[int]]], padding: int = 0, finished: tuple[str, ...] = ()) -> None:
        """One forward of (request id, token ids, positions) in the runner's order, then padding."""
        ids = [t for _, tokens, _ in batch for t in tokens] + [0] * padding
        positions = [p for _, _, where in batch for p in where] + [0] * padding
        output = SimpleNamespace(num_scheduled_tokens={rid: len(tokens) for rid, tokens, _ in batch}, finished_req_ids=set(finished))
        self.requests.scheduled(output, SimpleNamespace(req_ids=[rid for rid, _, _ in batch]))
        self.captured[vllm_capture.TOKENS].append(torch.tensor(ids))
        self.captured[vllm_capture.POSITIONS].append(torch.tensor(positions))
        # a row's state: a function of its request and position, so a misplaced row shows
        state = torch.tensor([[float(hash(rid) % 97), float(p)] for rid, _, where in batch for p in where] + [[-1.0, -1.0]] * padding)
        self.captured["1"].append(state)
        self.captured[vllm_capture.FINAL].append(state * 2)
        self.requests.guarded(self.requests.forward_done)


def _mark(n: int) -> str:
    return f"eagleops-{n:024x}"


def test_the_worker_keeps_each_requests_rows_through_chunks_decode_and_preemption(tmp_path):
    a, b, other = f"chatcmpl-{_mark(1)}-1a2b3c4d", f"chatcmpl-{_mark(2)}-5e6f7a8b", "chatcmpl-someone-else-0000"
    worker = _FakeWorker()
    worker.forward([(a, [5, 6, 7], [0, 1, 2]), (other, [9, 9], [0, 1])], padding=3)  # a's prompt, first chunk
    worker.forward([(b, [8, 8], [0, 1]), (a, [4], [3])])  # b's prompt; a's last prompt id (another order)
    worker.forward([(a, [11], [4]), (b, [12], [2])])  # decode
    worker.forward([(b, [8, 8, 12], [0, 1, 2])])  # b preempted and recomputed
    worker.forward([(b, [13], [3])], finished=(a,))
    written = worker.requests.take(str(tmp_path / "chunk"), 0, [[_mark(1), 5], [_mark(2), 4], [_mark(3), 2]], [])
    assert written["missing"] == {_mark(3): "no rows captured"}
    from safetensors.torch import load_file

    chunk = load_file(str(tmp_path / "chunk.rank0.safetensors"))
    assert chunk["offsets"].tolist() == [0, 5, 9]
    assert chunk["input_ids"].tolist() == [5, 6, 7, 4, 11, 8, 8, 12, 13]
    assert chunk["1"][:, 1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]  # each row at its own position
    assert set(chunk["1"][:5, 0].tolist()) == {float(hash(a) % 97)} and set(chunk["1"][5:, 0].tolist()) == {float(hash(b) % 97)}
    assert written["written"][_mark(1)] == sequence_digest([5, 6, 7, 4, 11])
    assert worker.requests.rows == {}  # taken, and nobody else's were kept


def test_rows_of_a_request_still_running_stay_through_another_take(tmp_path):
    from safetensors.torch import load_file

    a, c = f"chatcmpl-{_mark(1)}-1", f"chatcmpl-{_mark(3)}-3"
    worker = _FakeWorker()
    worker.forward([(a, [1, 2], [0, 1]), (c, [7, 8, 9], [0, 1, 2])])
    worker.forward([(c, [10], [3]), (a, [3], [2])])
    worker.requests.take(str(tmp_path / "one"), 0, [[_mark(1), 3]], [])
    assert worker.requests.rows == {_mark(3): 4}
    worker.forward([(c, [11], [4]), (f"chatcmpl-{_mark(4)}-4", [5, 5], [0, 1])])  # a request that comes after a take
    worker.requests.take(str(tmp_path / "two"), 0, [[_mark(3), 5]], [_mark(9)])  # forgetting an unknown mark is no error
    two = load_file(str(tmp_path / "two.rank0.safetensors"))
    assert two["input_ids"].tolist() == [7, 8, 9, 10, 11] and two["1"][:, 1].tolist() == [0, 1, 2, 3, 4]
    assert worker.requests.rows == {_mark(4): 2}


def test_a_failure_in_the_engine_loop_is_said_at_the_next_take_not_raised_there(tmp_path):
    worker = _FakeWorker()
    worker.captured["1"].append(torch.zeros(1, 3))  # a row of another width: rows that cannot be joined
    worker.forward([(f"chatcmpl-{_mark(1)}-x", [5, 6], [0, 1])])  # through the guard, as the hook runs it
    with pytest.raises(RuntimeError, match="the capture failed in vLLM's engine loop"):
        worker.requests.take(str(tmp_path / "chunk"), 0, [[_mark(1), 1]], [])
    worker.forward([(f"chatcmpl-{_mark(2)}-y", [7, 8], [0, 1])])  # the capture goes on
    assert worker.requests.take(str(tmp_path / "chunk"), 0, [[_mark(2), 2]], [])["written"]


def test_a_take_that_wants_more_rows_than_were_computed_writes_none(tmp_path):
    worker = _FakeWorker()
    worker.forward([(f"chatcmpl-{_mark(1)}-x", [5, 6], [0, 1])])
    report = worker.requests.take(str(tmp_path / "chunk"), 0, [[_mark(1), 3]], [])
    assert report["missing"] == {_mark(1): "2 of 3 rows captured"}
    assert not list(tmp_path.iterdir())


# ---- generate: which replies are kept, and the store's commit --------------------------------------


def test_a_reply_whose_rows_the_next_prompt_holds_is_not_kept():
    prompts = [[1, 2], [1, 2, 3, 4, 9, 5], [7]]
    replies = [[3, 4], [6, 7], [8]]
    refs = capture_refs([_mark(1), _mark(2), _mark(3)], prompts, replies)
    # the first reply's rows (1 2 3) are the second request's first rows; the second's are not the third's
    assert [(ref.mark, ref.kept) for ref in refs] == [(_mark(1), False), (_mark(2), True), (_mark(3), True)]
    assert refs[1].ids == (1, 2, 3, 4, 9, 5, 6, 7) and refs[1].rows == 7
    assert capture_refs([None], [[1]], [[2]]) == []  # a reply from an endpoint that does not capture


class _FakeCapture:
    """Takes every reply whole, as the workers would, and writes the chunk file."""

    def __init__(self, problems: list[str] | None = None) -> None:
        self.takes: list[tuple[Path, list[CaptureRef]]] = []
        self.forgotten: list[str] = []
        self.on_problem = (problems if problems is not None else []).append

    def take(self, stem: Path, refs, forget=()) -> TakeReport:
        stem.parent.mkdir(parents=True, exist_ok=True)
        self.takes.append((stem, list(refs)))
        self.forgotten.extend(forget)
        Path(f"{stem}.rank0.safetensors").write_bytes(b"x" * sum(ref.rows for ref in refs))
        return TakeReport({ref.mark: ref.rows for ref in refs}, {}, bytes=sum(ref.rows for ref in refs))


def _prompt(offset: int) -> Prompt:
    return Prompt(prompt_id=f"p{offset}", messages=({"role": "user", "content": "hi"},), offset=offset, end=offset + 1, line=offset + 1)


def test_a_batch_takes_its_rows_before_its_records_land_and_a_kill_between_leaves_nothing(tmp_path):
    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(10)))
    files = DatasetFiles(tmp_path / "ds")
    capture = _FakeCapture()
    store = DatasetStore(files.dir, "ds", source, capture=capture)  # type: ignore[arg-type]
    store.open()
    for offset in range(3):
        earlier = CaptureRef(_mark(10 + offset), (1, 2), kept=False)  # a reply the next one's rows hold
        store.add_record(
            _prompt(offset), {"source_offset": offset, "completion_tokens": 2}, (earlier, CaptureRef(_mark(offset), (1, 2, 3)))
        )
    asyncio.run(store.flush())
    assert [stem.name for stem, _ in capture.takes] == ["capture-000000000000"]
    assert [ref.mark for ref in capture.takes[0][1]] == [_mark(0), _mark(1), _mark(2)]
    assert capture.forgotten == [_mark(10), _mark(11), _mark(12)]
    records = [json.loads(line) for line in files.data.read_text().splitlines()]
    assert [r["captured_rows"] for r in records] == [2, 2, 2]
    assert store.durable.captured_rows == 6
    # killed after the next batch's chunk, before its records: the chunk sits at data's end
    orphan = files.capture_chunk(files.data.stat().st_size)
    Path(f"{orphan}.rank0.safetensors").write_bytes(b"y")
    reopened = DatasetStore(files.dir, "ds", source)
    reopened.open()
    assert [path.name for _, path in files.capture_chunks()] == ["capture-000000000000.rank0.safetensors"]
    assert reopened.durable.captured_rows == 6 and reopened.captured_bytes == 6


class _Gone(_FakeCapture):
    def take(self, stem, refs, forget=()):
        raise OSError("connection refused")


class _Partial(_FakeCapture):
    def take(self, stem, refs, forget=()):
        return TakeReport({}, {ref.mark: "no rows captured" for ref in refs})


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        (_Gone, "hidden states of 1 replies not captured (connection refused)"),
        (_Partial, "1 of 1 replies' hidden states not captured (no rows captured)"),
    ],
)
def test_a_batch_whose_rows_were_not_taken_lands_and_says_so(tmp_path, kind, said):
    source = tmp_path / "src.jsonl"
    source.write_text(json.dumps({"id": 0}) + "\n")
    problems: list[str] = []
    store = DatasetStore(tmp_path / "ds", "ds", source, capture=kind(problems))
    store.open()
    store.add_record(_prompt(0), {"source_offset": 0}, (CaptureRef(_mark(0), (1, 2)),))
    asyncio.run(store.flush())
    assert "captured_rows" not in json.loads(store.data_path.read_text())
    assert problems == [f"ds: {said}; extract captures them"]


class _Workers:
    """collective_rpc as vLLM's two tensor parallel workers answer it: rank 0 captures."""

    def __init__(self, digest_of=lambda ids: sequence_digest(ids)) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.capturing, self.digest_of = True, digest_of

    def __call__(self, base_url, log_path, method, *args):
        self.calls.append((method, args))
        if method != "eagleops_capture_take":
            self.capturing = True
            return ["[]", "[]"]
        if not self.capturing:
            return [json.dumps({"capturing": False, "peer": False}), json.dumps({"capturing": False, "peer": True})]
        wanted = json.loads(args[1])["take"]
        if wanted:  # as the workers: no rows, no file
            Path(f"{args[0]}.rank0.safetensors").write_bytes(b"z" * sum(rows for _, rows in wanted))
        written = {mark: self.digest_of(IDS[mark][:rows]) for mark, rows in wanted}
        return [json.dumps({"capturing": True, "written": written, "missing": {}}), json.dumps({"capturing": False, "peer": True})]


IDS = {_mark(1): (5, 6, 7, 8), _mark(2): (9, 9, 9)}


def test_the_served_capture_checks_the_rows_and_starts_again_after_a_restart(tmp_path):
    from eagleops.pipeline.generate.capture import ServedCapture

    workers = _Workers()
    capture = ServedCapture("http://127.0.0.1:1", tmp_path / "log", (1, 2, 3), rpc=workers)
    refs = [CaptureRef(mark, ids) for mark, ids in IDS.items()]
    report = capture.take(tmp_path / "c" / "capture-000000000000", refs)
    assert report.rows == {_mark(1): 3, _mark(2): 2} and report.bytes == 5 and capture.taken_bytes == 5
    workers.capturing = False  # vLLM restarted: no capture runs in it
    report = capture.take(tmp_path / "c" / "capture-000000000100", refs)
    assert report.restarted and report.rows == {} and workers.calls[-1][0] == "eagleops_capture_requests"
    workers.digest_of = lambda ids: sequence_digest(ids[::-1])  # rows that are not the reply's ids
    with pytest.raises(RunError, match="rows of other tokens"):
        capture.take(tmp_path / "c" / "capture-000000000200", refs)
    assert not list((tmp_path / "c").glob("capture-000000000200*"))


def test_captures_stop_at_max_cache_gb_and_say_so_once(tmp_path):
    from eagleops.pipeline.generate.capture import ServedCapture

    problems: list[str] = []
    workers = _Workers()
    capture = ServedCapture("http://127.0.0.1:1", tmp_path / "log", (1, 2, 3), rpc=workers, on_problem=problems.append)
    capture.limit_bytes, capture.taken_bytes = 4, 4
    for n in range(2):
        report = capture.take(tmp_path / f"capture-{n:012d}", [CaptureRef(_mark(1), IDS[_mark(1)])])
        assert report.rows == {} and report.missing == {}
        assert json.loads(workers.calls[-1][1][1]) == {"take": [], "forget": [_mark(1)]}  # the workers drop the rows
    assert len(problems) == 1 and "extract.max_cache_gb" in problems[0]
    assert not list(tmp_path.glob("capture-*"))


# ---- extract: a sample takes the rows of any capture that begins with its ids ----------------------


def _config(tmp_path: Path, max_length: int = 64) -> SimpleNamespace:
    from eagleops.pipeline.layout import RunLayout

    return SimpleNamespace(
        datasets=[SimpleNamespace(name="ds")], layout=RunLayout(tmp_path), prepare=SimpleNamespace(max_length=max_length)
    )


def _write_capture(tmp_path: Path, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """A chunk as the workers write it: each sequence's rows (all its ids but the last)."""
    rows = [seq[:-1] for seq in sequences]
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    n = len(ids)
    tensors = {str(layer): torch.randn(n, H).to(torch.bfloat16) for layer in LAYERS}
    tensors |= {
        vllm_capture.FINAL: torch.randn(n, H).to(torch.bfloat16),
        vllm_capture.TOKENS: ids,
        vllm_capture.OFFSETS: torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()]),
    }
    stem = DatasetFiles(tmp_path / "ds").capture_chunk(0)
    stem.parent.mkdir(parents=True)
    save_file(tensors, f"{stem}.rank0.safetensors")
    return tensors


def test_a_sample_takes_the_rows_of_the_capture_it_begins(tmp_path):
    chunk = _write_capture(tmp_path, [[1, 2, 3, 4, 5], [1, 2, 9, 9]])
    generated = GeneratedRows.find(_config(tmp_path, max_length=3), LAYERS)
    assert generated is not None
    aux, final = generated.features(torch.tensor([1, 2, 3, 4, 5]))  # the whole sequence: last row zero
    assert torch.equal(final[:4], chunk[vllm_capture.FINAL][:4]) and not final[4].any()
    assert torch.equal(aux[:4, H : 2 * H], chunk["2"][:4])
    aux, final = generated.features(torch.tensor([1, 2, 3]))  # cut at max_length: every row captured
    assert torch.equal(final, chunk[vllm_capture.FINAL][:3])
    assert generated.features(torch.tensor([1, 2, 9, 9]))[1][:3].equal(chunk[vllm_capture.FINAL][4:7])
    assert generated.features(torch.tensor([1, 2, 3, 4, 5, 6])) is None  # an end id the server never fed
    assert generated.features(torch.tensor([1, 2, 3, 7])) is None  # other ids
    assert generated.features(torch.tensor([1, 2, 3, 4])) is None  # a prefix no sample of max_length 3 is


def test_a_shard_mixes_captured_rows_with_computed_ones(tmp_path):
    chunk = _write_capture(tmp_path, [[1, 2, 3, 4]])
    generated = GeneratedRows.find(_config(tmp_path), LAYERS)
    samples = [(torch.tensor([7, 7]), torch.tensor([0, 1])), (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1]))]
    asked = []

    def compute(part):
        asked.append(part)
        n = sum(len(ids) for ids, _ in part)
        return [0, n], torch.full((n, 3 * H), 5.0, dtype=torch.bfloat16), torch.full((n, H), 6.0, dtype=torch.bfloat16)

    offsets, aux, final, free = shard_from_generate(generated, samples, compute)
    assert offsets == [0, 2, 6] and free == 4
    assert [len(part) for part in asked] == [1] and torch.equal(asked[0][0][0], samples[0][0])
    assert (final[:2] == 6).all() and torch.equal(final[2:5], chunk[vllm_capture.FINAL][:3]) and not final[5].any()


def test_captures_of_other_layers_are_not_used(tmp_path):
    _write_capture(tmp_path, [[1, 2, 3]])
    assert GeneratedRows.find(_config(tmp_path), (1, 2, 4)) is None


# ---- the operator's view: rows captured while generate runs ----------------------------------------


async def test_the_console_shows_the_rows_captured_while_generate_runs():
    """At the design size, the stages pane says what extract need not do, and each dataset's
    line what it captured (`eagleops status` prints the same line)."""
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.panes import StagesPane
    from eagleops.console.report import status_line
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    captured = DatasetProgress("B1", DatasetState.RUNNING, 12_000, 50_000, 80, captured_rows=23_456, captured_bytes=3 * 2**30)
    link = ScriptedLink([*fixed_events(), captured])
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        stages = str(app.query_one(StagesPane).render())
    lines = [line.rstrip() for line in stages.splitlines()]
    below = lines[lines.index("· extract   pending") + 1]
    assert below == "  23.5k rows, 3.0 GiB" and len(below) <= 23, stages  # the pane is 23 columns wide at 80x24
    assert "captured 23.5k rows 3.0 GiB" in status_line(captured, 120)
