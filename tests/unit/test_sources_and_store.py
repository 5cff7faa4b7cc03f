import asyncio
import json

import pytest

from eagleops.pipeline.generate.store import DatasetStore, StoreError
from eagleops.pipeline.sources import BadLine, Prompt, SourceReader, prompt_id_for
from tests.conftest import read_jsonl, write_jsonl


def test_reads_every_format_and_names_bad_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}]},
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "a1"},
                    {"role": "user", "content": "q2"},
                ]
            },
            {"prompt": "just this"},
            "{not json",
            {"messages": [{"role": "user"}]},
            "",
            {"conversations": [{"from": "robot", "value": "x"}]},
        ],
    )
    items = list(SourceReader(path))
    prompts = [i for i in items if isinstance(i, Prompt)]
    bad = [i for i in items if isinstance(i, BadLine)]
    assert [p.prompt_id for p in prompts][0] == "a"
    assert prompts[0].messages == ({"role": "user", "content": "hi"},)
    assert [m["content"] for m in prompts[1].messages] == ["s", "q1", "a1", "q2"]
    assert prompts[1].prompt_id == prompt_id_for(prompts[1].messages)
    assert prompts[2].messages == ({"role": "user", "content": "just this"},)
    assert [b.message for b in bad] == [
        f"{path}:4: <json>: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
        f"{path}:5: messages[0].content: missing or not a string (the turn has: role)",
        f"{path}:7: conversations[0].from: unknown role 'robot' (map it in [datasets.fields] roles)",
    ]


def test_reader_resumes_from_a_byte_offset(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    items = list(SourceReader(path))
    fifth = items[5]
    rest = list(SourceReader(path, offset=fifth.offset, line=fifth.line - 1))
    assert rest == items[5:]


def _prompt(i: int, offset: int) -> Prompt:
    return Prompt(f"p{i}", ({"role": "user", "content": f"p{i}"},), offset, offset + 10, i + 1)


def _record(p: Prompt, tokens: int = 5) -> dict:
    return {"id": p.prompt_id, "source_offset": p.offset, "completion_tokens": tokens, "conversations": []}


async def _store_with(tmp_path, source, done: list[int]) -> DatasetStore:
    store = DatasetStore(tmp_path / "out", "d", source)
    store.open()
    for i in done:
        p = _prompt(i, i * 10)
        store.dispatched(p)
        store.add_record(p, _record(p))
    await store.flush()
    return store


async def test_watermark_skips_out_of_order_completions(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    store = DatasetStore(tmp_path / "out", "d", source)
    store.open()
    prompts = [_prompt(i, i * 10) for i in range(5)]
    for p in prompts:
        store.dispatched(p)
    store.advanced(50, 5)
    for i in (0, 1, 3):  # 2 and 4 still in flight when the run dies
        store.add_record(prompts[i], _record(prompts[i]))
    await store.flush()
    manifest = json.loads(store.manifest_path.read_text())
    assert manifest["watermark"] == {"offset": 20, "lines": 2}
    assert manifest["done_beyond"] == [30]  # source offsets: two rows sharing an id are two pieces of work
    again = DatasetStore(tmp_path / "out", "d", source)
    again.open()
    assert again.reader_position() == (20, 2)
    assert again.skip(prompts[3]) and not again.skip(prompts[2])
    assert again.durable.samples == 3 and again.durable.tokens == 15


async def test_records_after_the_manifest_are_recovered_and_a_torn_tail_cut(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    store = await _store_with(tmp_path, source, [0, 1])
    # A batch reached the file but the run died before the manifest was replaced ...
    with open(store.data_path, "ab") as f:
        f.write((json.dumps(_record(_prompt(2, 20), 7)) + "\n").encode())
        f.write(b'{"id": "p3", "source_offset": 30, "complet')  # ... mid-line
    again = DatasetStore(tmp_path / "out", "d", source)
    again.open()
    assert again.recovered_records == 1 and again.repaired_bytes > 0
    assert again.durable.samples == 3 and again.durable.tokens == 17
    assert again.skip(_prompt(2, 20)) and not again.skip(_prompt(3, 30))
    assert [r["id"] for r in read_jsonl(again.data_path)] == ["p0", "p1", "p2"]


async def test_resume_never_reads_what_the_manifest_covers(tmp_path):
    """O(1) resume: bytes before the committed length are not parsed (here they are garbage)."""
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    store = await _store_with(tmp_path, source, [0, 1, 2])
    size = store.data_path.stat().st_size
    store.data_path.write_bytes(b"\xff" * (size - 1) + b"\n")
    again = DatasetStore(tmp_path / "out", "d", source)
    again.open()
    assert again.durable.samples == 3


async def test_a_changed_source_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    store = DatasetStore(tmp_path / "out", "d", source)
    store.open()
    p = _prompt(0, 0)
    store.dispatched(p)
    store.advanced(10, 1)
    store.add_record(p, _record(p))
    await store.flush()
    source.write_text("y" * 9 + "\n" + source.read_text()[10:])
    with pytest.raises(StoreError, match="changed since this output was written"):
        DatasetStore(tmp_path / "out", "d", source).open()


async def test_output_that_shrank_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)
    store = await _store_with(tmp_path, source, [0, 1])
    store.data_path.write_bytes(b"")
    with pytest.raises(StoreError, match="shorter than"):
        DatasetStore(tmp_path / "out", "d", source).open()


def test_flush_runs_off_the_loop(tmp_path):
    """The fsyncs happen in a worker thread: the loop keeps ticking meanwhile."""
    source = write_jsonl(tmp_path / "s.jsonl", ["x" * 9] * 10)

    async def main():
        store = DatasetStore(tmp_path / "out", "d", source)
        store.open()
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        for i in range(200):
            p = _prompt(i, i * 10)
            store.dispatched(p)
            store.add_record(p, _record(p))
        await store.flush()
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 1
