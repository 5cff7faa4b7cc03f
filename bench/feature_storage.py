"""Feature storage: where does fp8's acceptance loss come from, and which layout loses nothing?

    python bench/feature_storage.py [--dir DIR] [--seeds 0 1 2]

Runs `eagleops demo` once (generate, prepare, extract with bf16 features). Then, for each
layout and seed, the bf16 features are rewritten as that layout would read them back (each part
quantized and dequantized to bf16 with the same functions extract and the reader use), and train
+ export + eval run on them with the same data, seed and schedule: only the stored values differ,
so the acceptance difference is the layout's alone. The baseline is bf16, measured in the same run.

The layouts split the two parts a token stores: ``aux`` (three layers' states: the drafter's
input) and ``final`` (the last layer's post-norm state: the teacher, through the target's head).
For each, the table also gives the quantization error and, for ``final``, how often the target's
top-1 token computed from the stored state differs from the one computed from bf16.

Bytes per token are what each layout's shard holds: at the demo's hidden size (64) and, by the
same arithmetic, at Kimi-K2.5's (7168); "measured" is the size extract wrote for the layouts it
can write (bf16, fp8, int8).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

from eagleops.pipeline.config import TargetConfig
from eagleops.pipeline.training.features.shards import CODECS, Int8
from eagleops.pipeline.training.modeling.profile import head_and_embeddings, learn_profile

FIXED = 4 + 1  # int32 id + uint8 loss mask per token


@dataclass(frozen=True)
class Layout:
    name: str
    aux: str  # a codec in CODECS, or bf16
    final: str

    def bytes_per_token(self, hidden: int, aux_layers: int = 3) -> float:
        aux, final = (Int8(keep=0) if c == "int8-plain" else CODECS[c.replace("-step", "")] for c in (self.aux, self.final))
        return FIXED + aux.bytes(hidden, aux_layers) + final.bytes(hidden, 1)


LAYOUTS = [
    Layout("bf16", "bf16", "bf16"),
    # the control: every value moved one bf16 step up or down at random, an error no layout
    # can beat; what it changes is training's own sensitivity to any change of its input
    Layout("bf16 +-1 step (control)", "bf16-step", "bf16-step"),
    Layout("fp8", "fp8", "fp8"),
    Layout("fp8 aux only", "fp8", "bf16"),
    Layout("fp8 final only", "bf16", "fp8"),
    Layout("int8, no values kept apart", "int8-plain", "int8-plain"),
    Layout("int8", "int8", "int8"),
]


def _cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "eagleops", *args], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"eagleops {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _run_file(run: Path, seed: int, storage: str = "bf16") -> Path:
    text = run.read_text()
    text = re.sub(r'\nstorage = "\w+"', "", text)
    text = re.sub(r"\nseed = \d+", "", text)
    text = text.replace("[extract]\n", f'[extract]\nstorage = "{storage}"\n').replace("[train]\n", f"[train]\nseed = {seed}\n")
    out = run.with_name(f"run-{storage}-{seed}.toml")
    out.write_text(text)
    return out


def _clear(out: Path, *names: str) -> None:
    for name in names:
        path = out / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _roundtrip(codec: str, states: torch.Tensor, layers: int) -> torch.Tensor:
    """What the reader hands train for bf16 ``states`` stored with ``codec``."""
    if codec == "bf16":
        return states
    if codec == "bf16-step":
        sign = torch.randint(0, 2, states.shape, generator=torch.Generator().manual_seed(states.numel())) * 2 - 1
        return (states.float() * (1 + sign * 2.0**-8)).to(torch.bfloat16)
    c = Int8(keep=0) if codec == "int8-plain" else CODECS[codec]
    return c.decode(c.encode(states.reshape(states.shape[0], layers, -1)), torch.bfloat16)


def rewrite(bf16: Path, target: Path, layout: Layout, head: torch.Tensor) -> dict:
    """Copy the bf16 features to ``target`` as ``layout`` reads them back; return its errors."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(bf16, target)
    index = json.loads((bf16 / "index.json").read_text())
    layers = len(index["aux_layers"])
    sq = {"aux": [0.0, 0.0], "final": [0.0, 0.0]}
    flips = tokens = 0
    for name in index["shards"]:
        with safe_open(str(bf16 / name), framework="pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
            metadata = handle.metadata()
        for key, codec, n in (("aux", layout.aux, layers), ("final", layout.final, 1)):
            stored = _roundtrip(codec, tensors[key], n)
            sq[key][0] += (stored.float() - tensors[key].float()).pow(2).sum().item()
            sq[key][1] += tensors[key].float().pow(2).sum().item()
            if key == "final":
                flips += ((stored.float() @ head.T).argmax(-1) != (tensors[key].float() @ head.T).argmax(-1)).sum().item()
                tokens += stored.shape[0]
            tensors[key] = stored.contiguous()
        save_file(tensors, str(target / name), metadata=metadata)
    return {
        "aux_error": (sq["aux"][0] / sq["aux"][1]) ** 0.5,
        "final_error": (sq["final"][0] / sq["final"][1]) ** 0.5,
        "top1_flips": flips / tokens,
    }


def measure(demo: Path, features: Path, seed: int) -> float:
    out = demo / "out"
    _clear(out, "features", "train", "drafter", "drafter-speculators", "eval.json")
    shutil.copytree(features, out / "features")
    run = _run_file(demo / "run.toml", seed)
    for stage in ("train", "export", "eval"):
        _cli(stage, str(run), "--no-tui")
    return json.loads((out / "eval.json").read_text())["acceptance_length"]


def written_bytes(demo: Path, storage: str) -> float:
    """Bytes per token of the shards extract itself writes with ``[extract] storage``."""
    out = demo / "out"
    _clear(out, "features")
    _cli("extract", str(_run_file(demo / "run.toml", 0, storage)), "--no-tui")
    index = json.loads((out / "features" / "index.json").read_text())
    return sum(s["bytes"] for s in index["shards"].values()) / sum(s["tokens"] for s in index["shards"].values())


def outlier_errors(hidden: int = 4096, tokens: int = 2048) -> list[tuple[str, float, float]]:
    """Each one-byte codec's relative error on a synthetic residual stream with the outliers
    large targets have (not measured on one here: no large target runs on this machine):
    Gaussian values, 6 outlier channels 50x as large in every token (LLM.int8's outlier
    features), and 1 token in 256 with one channel at 1000 (the "massive activations" of a
    BOS-like token). Error over all values, and over the ordinary channels of ordinary tokens."""
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, 1, hidden, generator=gen)
    outliers = torch.randperm(hidden, generator=gen)[:6]
    states[:, :, outliers] *= 50
    massive = torch.arange(0, tokens, 256)
    states[massive, :, outliers[0]] = 1000.0
    states = states.bfloat16()
    ordinary = torch.ones_like(states, dtype=torch.bool)
    ordinary[:, :, outliers] = False
    ordinary[massive] = False
    rows = []
    for name in ("fp8", "int8-plain", "int8"):
        back = _roundtrip(name, states.reshape(tokens, hidden), 1).reshape(states.shape).float()
        err = back - states.float()
        rows.append((name, (err.norm() / states.float().norm()).item(), (err[ordinary].norm() / states.float()[ordinary].norm()).item()))
    return rows


def feature_errors(features: Path) -> None:
    """Each codec's relative error on an extract's own bf16 features (a real target's)."""
    index = json.loads((features / "index.json").read_text())
    layers = len(index["aux_layers"])
    print(f"## Codec errors on {features} (hidden {index['hidden_size']})\n")
    print("| codec | aux rel. error | final rel. error |")
    print("|---|---|---|")
    for codec in ("fp8", "int8-plain", "int8"):
        sq = {"aux": [0.0, 0.0], "final": [0.0, 0.0]}
        for name in index["shards"]:
            with safe_open(str(features / name), framework="pt") as handle:
                for key, n in (("aux", layers), ("final", 1)):
                    states = handle.get_tensor(key)
                    sq[key][0] += (_roundtrip(codec, states, n).float() - states.float()).pow(2).sum().item()
                    sq[key][1] += states.float().pow(2).sum().item()
        print(f"| {codec} | {(sq['aux'][0] / sq['aux'][1]) ** 0.5:.4f} | {(sq['final'][0] / sq['final'][1]) ** 0.5:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None, help="a demo folder to reuse (made if absent)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layouts", nargs="+", default=[layout.name for layout in LAYOUTS])
    parser.add_argument("--threads", default="2", help="torch threads for every stage: the same in each run, so results repeat")
    parser.add_argument("--features", type=Path, default=None, help="only print each codec's error on these bf16 features")
    args = parser.parse_args()
    if args.features is not None:
        return feature_errors(args.features)
    ENV["EAGLEOPS_THREADS"] = args.threads
    demo = args.dir or Path(tempfile.mkdtemp(prefix="eagleops-fp8-"))
    if not (demo / "out" / "prepared").exists():
        _cli("demo", "--no-tui", "--dir", str(demo))
    measured = {storage: written_bytes(demo, storage) for storage in ("fp8", "int8", "bf16")}
    bf16 = demo / "features-extracted"
    shutil.rmtree(bf16, ignore_errors=True)
    shutil.copytree(demo / "out" / "features", bf16)
    index = json.loads((bf16 / "index.json").read_text())
    hidden = index["hidden_size"]
    model = demo / index["target"] if not Path(index["target"]).is_absolute() else Path(index["target"])
    head = head_and_embeddings(learn_profile(TargetConfig(model=model)))[0].float()
    layouts = [layout for layout in LAYOUTS if layout.name in args.layouts]
    rows = []
    for layout in layouts:
        features = demo / f"layout-{layout.name.replace(' ', '_').replace(',', '')}"
        errors = rewrite(bf16, features, layout, head)
        accept = {seed: measure(demo, features, seed) for seed in args.seeds}
        rows.append((layout, errors, accept))
        print(f"# {layout.name}: {errors} {accept}", file=sys.stderr, flush=True)
    base = rows[0][2]
    print(f"## Feature layouts on the demo (hidden {hidden}, seeds {args.seeds}; baseline bf16 in the same run)\n")
    print("| layout | bytes/token (demo) | measured | x bf16 at hidden 7168 | aux rel. error | final rel. error | top-1 flips | acceptance by seed | mean change |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, errors, accept in rows:
        change = statistics.mean(100 * (accept[s] - base[s]) / base[s] for s in args.seeds)
        store = {("bf16", "bf16"): "bf16", ("fp8", "fp8"): "fp8", ("int8", "int8"): "int8"}.get((layout.aux, layout.final))
        print(
            f"| {layout.name} | {layout.bytes_per_token(hidden):.1f} | {measured[store]:.1f} | "
            if store
            else f"| {layout.name} | {layout.bytes_per_token(hidden):.1f} | - | ",
            end="",
        )
        print(
            f"{layout.bytes_per_token(7168) / LAYOUTS[0].bytes_per_token(7168):.3f}x | {errors['aux_error']:.4f} | "
            f"{errors['final_error']:.4f} | {100 * errors['top1_flips']:.2f}% | "
            f"{' / '.join(f'{accept[s]:.3f}' for s in args.seeds)} | {change:+.2f}% |"
        )
    print("\n## The same codecs on a synthetic residual stream with large targets' outliers (hidden 4096)\n")
    print("| codec | rel. error, all values | rel. error, ordinary channels of ordinary tokens |")
    print("|---|---|---|")
    for name, every, ordinary in outlier_errors():
        print(f"| {name} | {every:.4f} | {ordinary:.4f} |")


if __name__ == "__main__":
    main()
