"""Sources in the shapes datasets are published in: compressed JSONL, JSON arrays, Parquet files,
globs and folders of shards, `datasets.save_to_disk` folders and hub-cache folders. Every one
reads the same rows and resumes from any row's position with nothing skipped or read twice; a
whole run over them survives kill -9."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from eagleops.pipeline.errors import InputError
from eagleops.pipeline.sources import BadLine, Prompt, Source, SourceReader, find_shards
from tests.conftest import read_jsonl, write_jsonl

ROWS = [
    {
        "id": f"r{i}",
        "conversations": [{"from": "human", "value": f"question {i} " + "ü" * (i % 3)}, {"from": "gpt", "value": f"answer {i}"}],
    }
    for i in range(23)
]


def _jsonl_bytes(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _parquet(path: Path, rows, row_group_size: int = 4) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _save_to_disk(folder: Path, rows, shards: int = 2, split: str | None = None) -> Path:
    import datasets

    data = datasets.Dataset.from_list(rows)
    if split:
        datasets.DatasetDict({split: data, "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(
            str(folder), num_shards={split: shards, "test": 1}
        )
    else:
        data.save_to_disk(str(folder), num_shards=shards)
    return folder


def _hub_cache(root: Path, rows) -> Path:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main."""
    repo = root / "datasets--org--chat"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs" / "main").write_text(sha)
    snapshot = repo / "snapshots" / sha / "data"
    snapshot.mkdir(parents=True)
    for split, part in (("train", rows), ("test", rows[:3])):
        blob = _parquet(repo / "blobs" / f"blob-{split}", part)
        (snapshot / f"{split}-00000-of-00001.parquet").symlink_to(blob)
    (repo / "snapshots" / sha / "README.md").write_text("---\nlicense: mit\n---\n")
    return repo


def _sources(tmp_path: Path) -> dict[str, Path]:
    out = {}
    out["jsonl"] = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(ROWS)))
    out["gz"] = tmp_path / "a.jsonl.gz"
    # two frames: zstd streams written in pieces must read as one
    (tmp_path / "a.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(_jsonl_bytes(ROWS[:10])) + zstandard.ZstdCompressor().compress(_jsonl_bytes(ROWS[10:]))
    )
    out["zst"] = tmp_path / "a.jsonl.zst"
    (tmp_path / "a.json").write_text(json.dumps(ROWS, indent=2, ensure_ascii=False))
    out["json"] = tmp_path / "a.json"
    out["parquet"] = _parquet(tmp_path / "a.parquet", ROWS)
    (tmp_path / "shards").mkdir()
    for k, start in enumerate(range(0, len(ROWS), 8)):
        _parquet(tmp_path / "shards" / f"part-{k}.parquet", ROWS[start : start + 8], row_group_size=3)
    out["glob"] = tmp_path / "shards" / "part-*.parquet"
    out["folder"] = tmp_path / "shards"
    out["saved"] = _save_to_disk(tmp_path / "saved", ROWS)
    out["saved-dict"] = _save_to_disk(tmp_path / "saved-dict", ROWS, split="train")
    out["hub"] = _hub_cache(tmp_path / "hub", ROWS)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return _sources(tmp_path_factory.mktemp("sources"))


KINDS = ["jsonl", "gz", "zst", "json", "parquet", "glob", "folder", "saved", "saved-dict", "hub"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_shape_reads_the_same_rows_and_resumes_at_each(sources, kind):
    items = list(SourceReader(sources[kind], "sharegpt"))
    assert all(isinstance(i, Prompt) for i in items), [i for i in items if isinstance(i, BadLine)]
    assert [i.prompt_id for i in items] == [r["id"] for r in ROWS]
    assert items[5].messages == ({"role": "user", "content": "question 5 üü"},)
    for k in range(len(items)):  # from any row's position, the rest exactly, in order
        rest = list(SourceReader(sources[kind], "sharegpt", offset=items[k].offset, line=items[k].line - 1))
        assert rest == items[k:]
    assert list(SourceReader(sources[kind], "sharegpt", offset=items[-1].end, line=items[-1].line)) == []


def test_a_shard_names_its_rows_and_the_positions_carry_the_shard(sources):
    items = list(SourceReader(sources["glob"], "sharegpt"))
    assert [i.shard for i in items[7:10]] == ["part-0.parquet", "part-1.parquet", "part-1.parquet"]
    assert [i.line for i in items[7:10]] == [8, 1, 2]
    assert items[8].offset == 1 << 44  # shard 1, row 0


def test_splits_are_chosen_and_a_wrong_one_names_the_choices(sources):
    assert len(find_shards(sources["hub"])) == 1  # train by default
    assert len(list(SourceReader(Source(sources["hub"], "test"), "sharegpt"))) == 3
    assert len(list(SourceReader(Source(sources["saved-dict"], "test"), "sharegpt"))) == 2
    with pytest.raises(InputError, match=r"no split 'dev' \(it has test, train\)"):
        find_shards(sources["saved-dict"], "dev")
    with pytest.raises(InputError, match="no file matches"):
        find_shards(sources["folder"] / "*.arrow")


def test_save_to_disk_writes_arrow_streams_we_read_without_datasets(sources):
    shards = find_shards(sources["saved"])
    assert [s.path.name for s in shards] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert json.loads((sources["saved"] / "state.json").read_text())["_data_files"]


def test_bad_rows_are_named_by_file_and_row(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "ok"}]}, {"conversations": [{"from": "robot", "value": "x"}]}]
    _parquet(tmp_path / "p.parquet", rows)
    items = list(SourceReader(tmp_path / "p.parquet", "sharegpt"))
    assert isinstance(items[1], BadLine)
    assert (
        items[1].message
        == f"{tmp_path / 'p.parquet'}: row 2: conversations[0].from: unknown role 'robot' (map it in [datasets.fields] roles)"
    )
    (tmp_path / "broken.json").write_text('[{"prompt": "a"}, {"prompt": ')
    items = list(SourceReader(tmp_path / "broken.json"))
    assert isinstance(items[0], Prompt) and isinstance(items[1], BadLine) and "invalid JSON" in items[1].reason
    (tmp_path / "object.json").write_text('{"prompt": "a"}')  # one object: JSONL of one line, as eagleops always read it
    assert [i.messages[0]["content"] for i in SourceReader(tmp_path / "object.json")] == ["a"]
    (tmp_path / "number.json").write_text("42")
    assert list(SourceReader(tmp_path / "number.json"))[0].reason == "expected an object, got int"


def test_a_json_array_item_larger_than_the_read_window(tmp_path):
    big = "x" * (3 << 20)
    (tmp_path / "big.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": big}, {"prompt": "c"}]))
    items = list(SourceReader(tmp_path / "big.json"))
    assert [len(i.messages[0]["content"]) for i in items] == [1, len(big), 1]
    assert list(SourceReader(tmp_path / "big.json", offset=items[2].offset, line=2)) == items[2:]


def test_resume_refuses_a_source_whose_shards_changed(tmp_path):
    from eagleops.pipeline.generate.store import DatasetStore, StoreError

    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(2):
        _parquet(folder / f"part-{k}.parquet", ROWS[k * 5 : k * 5 + 5])
    store = DatasetStore(tmp_path / "out", "d", Source(folder))
    store.open()
    items = list(SourceReader(store.source, "sharegpt"))
    store.advanced(items[6].end, items[6].line)  # into the second shard
    store._write_manifest(store._manifest())
    DatasetStore(tmp_path / "out", "d", Source(folder)).open()  # unchanged: resumes
    _parquet(folder / "part-0.parquet", ROWS[:4])  # an earlier shard rewritten
    with pytest.raises(StoreError, match="changed since this output was written"):
        DatasetStore(tmp_path / "out", "d", Source(folder)).open()


# ---- a whole run over them, killed and resumed --------------------------------------------------


def _rows(prefix: str, n: int) -> list[dict]:
    return [
        {"uid": f"{prefix}{i}", "instruction": f"{prefix} {i} [[tokens:5]] [[delay:0.15]]", "input": "", "output": "old"} for i in range(n)
    ]


def test_parquet_hf_and_compressed_sources_survive_kill_9(tmp_path, fault_server):
    """Three datasets of other shapes and field maps; the run is killed three times and finished:
    every row's reply is there once."""
    shards = tmp_path / "pq"
    shards.mkdir()
    pq_rows = _rows("p", 60)
    for k in range(3):
        _parquet(shards / f"train-{k:05d}-of-00003.parquet", pq_rows[k * 20 : k * 20 + 20], row_group_size=6)
    hf_rows = [{"key": f"h{i}", "chat": [{"speaker": "USER", "text": f"h {i} [[tokens:5]] [[delay:0.15]]"}]} for i in range(50)]
    _save_to_disk(tmp_path / "hf", hf_rows, shards=2)
    zst_rows = [{"id": f"z{i}", "messages": [{"role": "user", "content": f"z {i} [[tokens:5]] [[delay:0.15]]"}]} for i in range(50)]
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(zst_rows)))
    run = tmp_path / "run.toml"
    run.write_text(
        f'name = "{tmp_path.name[:20]}"\noutput_dir = "out"\nconcurrency = 4\n'
        f'[[endpoints]]\nbase_url = "{fault_server.base_url}"\nmodel = "m"\n'
        f'[[datasets]]\nname = "PQ"\npath = "{shards}/*.parquet"\ntoken_budget = "1G"\nformat = "prompt-response"\n'
        f'[datasets.fields]\nid = "uid"\n'
        f'[[datasets]]\nname = "HF"\npath = "{tmp_path / "hf"}"\ntoken_budget = "1G"\n'
        f'[datasets.fields]\nconversation = "chat"\nrole = "speaker"\ncontent = "text"\nid = "key"\nroles = {{ USER = "user" }}\n'
        f'[[datasets]]\nname = "ZS"\npath = "{tmp_path / "z.jsonl.zst"}"\ntoken_budget = "1G"\nformat = "openai"\n'
    )
    command = [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for delay in (1.2, 0.9, 1.4):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(delay)
        finally:
            proc.kill()
            proc.wait()
    before = {name: len(read_jsonl(tmp_path / "out" / name / "data.jsonl")) for name in ("PQ", "HF", "ZS")}
    assert 0 < sum(before.values()) < 160, before  # the kills came mid-run: the last run resumes, it does not start over
    final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    for name, rows, key in (("PQ", pq_rows, "uid"), ("HF", hf_rows, "key"), ("ZS", zst_rows, "id")):
        records = read_jsonl(tmp_path / "out" / name / "data.jsonl")
        assert sorted(r["id"] for r in records) == sorted(row[key] for row in rows), name
        assert (tmp_path / "out" / name / "failed.jsonl").read_text() == ""
    pq_records = read_jsonl(tmp_path / "out" / "PQ" / "data.jsonl")
    assert {r["source_file"] for r in pq_records} == {f"train-{k:05d}-of-00003.parquet" for k in range(3)}
    by_id = {r["id"]: r for r in pq_records}
    assert by_id["p0"]["conversations"][0] == {"role": "user", "content": pq_rows[0]["instruction"]}  # Alpaca's empty input adds nothing


def test_sources_command_shows_rows_as_read(tmp_path, sources):
    run = tmp_path / "run.toml"
    run.write_text(
        'output_dir = "out"\n[[endpoints]]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
        f'[[datasets]]\nname = "H"\npath = "{sources["hub"]}"\ntoken_budget = 10\nformat = "sharegpt"\n'
        f'[[datasets]]\nname = "W"\npath = "{sources["parquet"]}"\ntoken_budget = 10\nformat = "openai"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(
        [sys.executable, "-m", "eagleops", "sources", str(run), "--rows", "2"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2  # W's map does not fit: said before any request
    assert "data/train-00000-of-00001.parquet (parquet" in done.stdout and "23 rows in 6 row groups" in done.stdout
    assert "user: question 0" in done.stdout
    assert "BAD" in done.stdout and "no 'messages' or" not in done.stdout
    assert "the row has: conversations, id" in done.stdout


def test_hub_shard_names_give_their_split(tmp_path):
    """UltraChat-style names: `data/train_sft-00000-of-00003-<hash>.parquet`; `split` picks one."""
    data = tmp_path / "data"
    data.mkdir()
    for split, rows in (("train_sft", ROWS[:5]), ("test_sft", ROWS[5:7]), ("train_gen", ROWS[7:8])):
        _parquet(data / f"{split}-00000-of-00001-0a1b2c3d.parquet", rows)
    assert [s.path.name for s in find_shards(tmp_path, "test_sft")] == ["test_sft-00000-of-00001-0a1b2c3d.parquet"]
    with pytest.raises(InputError, match=r"several splits \(test_sft, train_gen, train_sft\); choose one with `split`"):
        find_shards(tmp_path)


def test_what_a_review_found_in_the_readers(tmp_path):
    """A `.json` of one object a line is JSONL (as before); a folder whose files name no split
    reads them all; an empty turn mid-chat is a turn; bare tool calls take OpenAI's shape."""
    (tmp_path / "lines.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [i.messages[0]["content"] for i in SourceReader(tmp_path / "lines.json")] == ["a", "b"]
    assert Source(tmp_path / "lines.json").is_single_jsonl()  # an older run's byte fingerprint still holds
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("shard_0.jsonl", "shard_1.jsonl", "test.jsonl"):
        (folder / name).write_text('{"prompt": "x"}\n')
    (folder / "dataset_infos.json").write_text("{}")
    assert sorted(s.path.name for s in find_shards(folder)) == ["shard_0.jsonl", "shard_1.jsonl", "test.jsonl"]
    assert [s.path.name for s in find_shards(folder, "test")] == ["test.jsonl"]
    row = {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}]}
    (tmp_path / "empty.jsonl").write_text(json.dumps(row) + "\n")
    (item,) = SourceReader(tmp_path / "empty.jsonl", "sharegpt")
    assert isinstance(item, Prompt) and [m["content"] for m in item.messages] == ["", "hi", "q"]
    calls = {"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]},
             {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}, {"role": "user", "content": "and?"}]}  # fmt: skip
    (tmp_path / "calls.jsonl").write_text(json.dumps(calls) + "\n")
    (item,) = SourceReader(tmp_path / "calls.jsonl", "openai")
    made = item.messages[1]["tool_calls"]
    assert made[0] == {"id": "call_1_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert [item.messages[2]["tool_call_id"], item.messages[3]["tool_call_id"]] == ["call_1_0", "call_1_1"]


def test_an_empty_user_turn_does_not_refuse_the_row(tmp_path):
    """Published chats (ShareGPT among them) hold empty turns, mid-way or at the end: `last`
    regenerates the reply to the last user turn with words, `all` drops only the trailing empty
    turn; a row is refused only when no user turn has words."""
    from eagleops.pipeline.config import field_map
    from eagleops.pipeline.sources import RowError, read_row

    fields = field_map("sharegpt", None, "id")
    turns = [
        {"from": "human", "value": "first"},
        {"from": "gpt", "value": "one"},
        {"from": "human", "value": ""},
        {"from": "gpt", "value": "two"},
        {"from": "human", "value": "third"},
        {"from": "gpt", "value": "three"},
        {"from": "human", "value": "  "},
    ]
    last = read_row({"id": "x", "conversations": turns}, fields, "last")
    assert [m["content"] for m in last.messages] == ["first", "one", "", "two", "third"]
    every = read_row({"id": "x", "conversations": turns}, fields, "all")
    assert [m["content"] for m in every.messages] == ["first", "one", "", "two", "third", "three"]
    with pytest.raises(RowError, match="every user turn is empty"):
        read_row({"id": "y", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]}, fields, "last")


def test_a_json_array_cut_off_mid_item_names_the_byte_where_it_breaks(tmp_path):
    """ShareGPT V3 as published ends mid-item: the rows before are read, the broken one names
    Python's own message and where in the file it is (not a message cut short)."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(rows)
    cut = text[: text.rindex('{"id": "2"') + 25]
    path = tmp_path / "cut.json"
    path.write_text(cut)
    items = list(SourceReader(path))
    assert [i.prompt_id for i in items if isinstance(i, Prompt)] == ["0", "1"]
    (bad,) = [i for i in items if isinstance(i, BadLine)]
    start = cut.rindex('"conversation')
    assert bad.message.endswith(
        f"invalid JSON: Unterminated string starting at (byte {start:,} of the file); the rest of the file is not read"
    )
