"""Generate-stage throughput and resume start-up, each against a baseline measured in the same run.

1. Requests/s and tokens/s that the whole engine (client, budget accounting, fsynced JSONL
   writes, manifest) sustains against a fast loopback server with canned answers, at 64 and
   256 in flight, side by side with the ``openai`` SDK's AsyncOpenAI client doing the same
   requests under a semaphore (no disk writes at all: the baseline is flattered).
2. Resume start-up on a ~1 GB generated output: ``DatasetStore.open`` (manifest + tail) vs a
   naive full re-scan (read and parse every line to rebuild the done set and token count).

    python bench/client_throughput.py [--requests 4000] [--resume-gb 1.0]

Needs ``pip install -e '.[bench]'`` (openai). Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.generate.store import MANIFEST_VERSION, DatasetStore, source_fingerprint
from eagleops.pipeline.servers.launch import start_server


def _prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"Write a short note about item {i}."}) + "\n")
    return path


async def _ours(base_url: str, work: Path, n: int, in_flight: int) -> float:
    out = work / f"ours-{in_flight}"
    shutil.rmtree(out, ignore_errors=True)
    source = _prompts(work / f"prompts-{n}.jsonl", n)
    config = parse_run(
        {
            "output_dir": str(out),
            "concurrency": in_flight,
            "sampling": {"max_tokens": 64},
            "endpoints": [{"base_url": base_url, "model": "m"}],
            "datasets": [{"name": "bench", "path": str(source), "token_budget": "1G"}],
        },
        base_dir=work,
    )
    engine = Engine(config)
    await engine.open()
    started = time.perf_counter()
    summary = await engine.run()
    elapsed = time.perf_counter() - started
    assert summary.datasets[0].samples == n, summary.datasets[0]
    return elapsed


async def _sdk(base_url: str, n: int, in_flight: int) -> float:
    # The SDK's own default transport, with its pool widened to the concurrency under test.
    import httpx2 as httpx  # the transport this openai release ships with
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    client = AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=5, http_client=DefaultAsyncHttpxClient(limits=limits, timeout=600)
    )
    gate = asyncio.Semaphore(in_flight)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with gate:
            reply = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Write a short note about item {i}."}],
                max_tokens=64,
                temperature=0.7,
                top_p=1.0,
            )
            tokens += reply.usage.completion_tokens

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for i in range(n):
            group.create_task(one(i))
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed


def _make_big_output(folder: Path, gigabytes: float) -> tuple[DatasetStore, int]:
    """A realistic data.jsonl (~2 KB per record) with the manifest a finished run leaves."""
    folder.mkdir(parents=True, exist_ok=True)
    answer = ("The drafter predicts the target's next tokens from fused hidden states. " * 24).strip()
    target = int(gigabytes * 1e9)
    data = folder / "out" / "big" / "data.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    source = folder / "source.jsonl"
    written = records = 0
    with open(data, "wb") as out, open(source, "wb") as src:
        while written < target:
            chunk = []
            for _ in range(1000):
                rid = f"p{records}"
                src_line = json.dumps({"id": rid, "prompt": f"note {records}"}).encode() + b"\n"
                src.write(src_line)
                rec = {"id": rid, "conversations": [{"role": "user", "content": f"note {records}"}, {"role": "assistant", "content": answer}],
                       "dataset": "big", "source_offset": 0, "source_line": records + 1, "finish_reason": "stop", "completion_tokens": 400}  # fmt: skip
                chunk.append(json.dumps(rec).encode() + b"\n")
                records += 1
            blob = b"".join(chunk)
            out.write(blob)
            written += len(blob)
    src_size = source.stat().st_size
    manifest = {
        "version": MANIFEST_VERSION, "dataset": "big", "source": str(source),
        "source_fingerprint": source_fingerprint(source, src_size),
        "watermark": {"offset": src_size, "lines": records}, "done_beyond": {},
        "committed": {"data": written, "failed": 0},
        "totals": {"samples": records, "tokens": 400 * records}, "budget_override": None,
    }  # fmt: skip
    (data.parent / "failed.jsonl").touch()
    (data.parent / "manifest.json").write_text(json.dumps(manifest))
    return DatasetStore(data.parent, "big", source), records


def _naive_rescan(path: Path) -> tuple[int, int]:
    done, tokens = set(), 0
    with open(path, "rb") as f:
        for line in f:
            record = json.loads(line)
            done.add(record["id"])
            tokens += record["completion_tokens"]
    return len(done), tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume-gb", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="eagleops-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    with start_server(["eagleops.pipeline.testservers.fault", "--tokens", "32"], work / "port", log_path=work / "server.log") as port:
        base_url = f"http://127.0.0.1:{port}/v1"
        asyncio.run(_sdk(base_url, 200, 16))  # warm both paths once
        asyncio.run(_ours(base_url, work, 200, 16))
        for in_flight in (64, 256):
            ours, sdk = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                ours.append(asyncio.run(_ours(base_url, work, args.requests, in_flight)))
                sdk.append(asyncio.run(_sdk(base_url, args.requests, in_flight)))
            o, s = statistics.median(ours), statistics.median(sdk)
            rows.append((in_flight, args.requests / o, 32 * args.requests / o, args.requests / s, 32 * args.requests / s, s / o))
    print(
        f"## Client throughput ({args.requests} requests x {args.repeats}, median; canned 32-token answers; loopback, {os.cpu_count()} cores shared with the server)\n"
    )
    print("| in flight | eagleops req/s | eagleops tok/s | AsyncOpenAI req/s | AsyncOpenAI tok/s | ratio (ours / SDK) |")
    print("|---|---|---|---|---|---|")
    for in_flight, orq, otk, srq, stk, ratio in rows:
        print(f"| {in_flight} | {orq:,.0f} | {otk:,.0f} | {srq:,.0f} | {stk:,.0f} | **{ratio:.2f}x** |")

    store, records = _make_big_output(work / "resume", args.resume_gb)
    size = store.data_path.stat().st_size
    opens = []
    for _ in range(5):
        fresh = DatasetStore(store.directory, "big", store.source)
        t = time.perf_counter()
        fresh.open()
        opens.append(time.perf_counter() - t)
        assert fresh.durable.samples == records
    t = time.perf_counter()
    count, _ = _naive_rescan(store.data_path)
    rescan = time.perf_counter() - t
    assert count == records
    ours = statistics.median(opens)
    print(f"\n## Resume start-up ({size / 1e9:.2f} GB, {records:,} records, warm page cache for both)\n")
    print("| method | time | share of re-scan |")
    print("|---|---|---|")
    print(f"| naive full re-scan (parse every line) | {rescan:.2f} s | 100% |")
    print(f"| eagleops manifest + tail (median of 5) | {ours * 1000:.2f} ms | **{100 * ours / rescan:.3f}%** |")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
