"""Training speed of our EAGLE-3 drafter against SpecForge 0.2.0's, on the same features and batches.

    python bench/train_vs_specforge.py [--specforge PATH] [--hidden 256] [--seq 512] [--batch 2]
        [--steps 10] [--rounds 3] [--ttt 7] [--lr 1e-3] [--device auto] [--profile]

Both sides train the same geometry (hidden, heads, vocab, draft vocab with the same d2t/t2d, TTT
length, step weight 0.8**i, sequence length, batch size) from the same initial weights (SpecForge's
initialisation, copied into ours) on the same batches, at the same constant learning rate, AdamW
without weight decay, gradients clipped at 0.5; fp32 on a CPU, fp32 weights under bf16 autocast on
CUDA. Rounds alternate (ours, SpecForge, ours, SpecForge ...); a round is ``--steps`` timed steps
after one untimed warm-up step (each step synchronised, timed with ``time.perf_counter``); the
table gives the median steps/s over rounds, the ratio ours/SpecForge, each side's last training
loss, and, before -> after training, a held-out loss and an acceptance proxy computed alike for both.

The features come from a toy target (random weights, no hub): a recurrent state over the token
embeddings gives three auxiliary layers (3H) and a final hidden state (H); the target's ``lm_head``
turns the final state into teacher logits; the next token is the target's argmax (a random token
with probability 0.1), so the drafter has something to learn. The draft vocabulary is the
``--draft-vocab`` most frequent tokens of the training data, as prepare picks it. The held-out
features are greedy. The proxy, computed by this script for both sides alike from the draft
logits of each TTT step: acc_i = share of positions where the draft's top-1 (mapped through d2t)
is the target's full-vocabulary argmax i+1 tokens ahead (the teacher-forced tokens being the
target's own greedy ones), and tau = sum_k prod_{j<=k} acc_j, the offline estimate of accepted
draft tokens per target step (without the target's bonus token). The held-out loss is
sum_i 0.8**i CE_i, CE_i the cross-entropy of the draft's step-i distribution against the target's
over the draft vocabulary, over the positions whose target top-1 is in it: one normalisation for
both (their training losses differ there: SpecForge averages over all batch x seq positions, ours
over the trained ones).

Our side: ``eagleops.pipeline.training.train.loop._Trainer.train_step`` itself (bound to a stand-in
``self``), which runs ``Eagle3Objective`` over ``Eagle3Drafter``, ``torch.optim.AdamW``,
``clip_grad_norm_(max_grad_norm)`` and a ``LambdaLR`` schedule (constant here).

SpecForge's side, all from its wheel: ``LlamaForCausalLMEagle3`` (draft model, embedding frozen as
its ``build_eagle3_draft`` does), ``OnlineEagle3Model`` (its TTT loop, teacher and loss),
``Eagle3TrainStrategy`` (offline ``target_repr="hidden_state"``: ``TargetHead.preprocess`` shift,
``TargetHead`` lm_head logits, 0.8**i weights), ``TrainerCore.train_step`` (its step and metric
reduction), ``BF16Optimizer`` (fp32 master AdamW, clip 0.5, ``constant`` schedule, no warm-up).
The only piece of its own not used: ``FSDPTrainingBackend`` (FSDP needs a process group); a
one-process backend in its place does what that backend does unwrapped (``loss.backward()``,
``optimizer.step()``). Its teacher is its default full-vocabulary one (``compact_teacher`` off):
``TargetHead`` logits [B, T, V], then ``_compute_target_p``; ours takes the top-1 over the head in
chunks and the draft-vocabulary rows' softmax. Attention: its ``sdpa`` backend (its default,
``flex_attention``, has no backward on a CPU in torch 2.13; ``--sf-attention flex_attention`` asks
for it on CUDA), which with TTT is its eager matmul path over cached keys, the same algorithm as
ours (ours: SDPA for step 0, the same eager matmul path for steps 1..k). Its ``torch.compile``
decorators (RMSNorm, RoPE, teacher, reference loss) stay on, as shipped (``--eager`` turns
compilation off; ours compiles nothing). On CUDA SpecForge natively keeps bf16 weights without
autocast; here both keep fp32 weights under bf16 autocast, so its BF16Optimizer's masters are
copies of fp32 weights.

Stubs: ``triton`` when it is not installed (a CPU box): ``specforge.core.loss`` imports it at load
for its fused ``LogSoftmaxLoss`` kernel; a stub with ``jit``, ``next_power_of_2`` and
``language.constexpr`` lets the module load (it is removed from ``sys.modules`` right after, so
torch never sees it), and on a CPU the loss is its own reference ``_compute_loss`` (the same
math, torch-compiled) in place of the Triton kernel. flash_attn, sglang and yunchang are not
imported on this path (flash_attn is optional there: it warns). The wheel pins torch 2.11 and
transformers 5.8; this runs it on the ones installed here.

Where SpecForge comes from: ``--specforge PATH`` (an unpacked wheel's folder or a ``.whl``, which is
unpacked under bench/_work), else ``$SPECFORGE_PATH``, else ``bench/_work/specforge``; with
``--download``, ``pip download --no-deps specforge==0.2.0`` into bench/_work first.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORK = ROOT / "bench" / "_work"
SPECFORGE_VERSION = "0.2.0"


# ---- SpecForge: where it is, and importing it on a CPU box -------------------------------------
def find_specforge(arg: str | None, download: bool) -> Path:
    candidates = [Path(arg)] if arg else [Path(p) for p in (os.environ.get("SPECFORGE_PATH"), WORK / "specforge") if p]
    if not arg and download and not any(c.exists() for c in candidates):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(WORK), f"specforge=={SPECFORGE_VERSION}"], check=True
        )
        candidates = sorted(WORK.glob(f"specforge-{SPECFORGE_VERSION}-*.whl"))
    for path in candidates:
        if path.is_file() and path.suffix == ".whl":
            target = WORK / "specforge"
            if not (target / "specforge").is_dir():
                with zipfile.ZipFile(path) as wheel:
                    wheel.extractall(target)
            return target
        if (path / "specforge" / "__init__.py").is_file():
            return path
    sys.exit(f"SpecForge {SPECFORGE_VERSION} not found in {[str(c) for c in candidates]}: pass --specforge PATH or --download")


def _triton_stub() -> dict[str, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.next_power_of_2 = lambda n: 1 << max(0, n - 1).bit_length()  # type: ignore[attr-defined]
    return {"triton": triton, "triton.language": language}


class _ReferenceLoss:
    """``LogSoftmaxLoss.apply`` on a device without Triton: SpecForge's own reference loss."""

    def __init__(self, reference):
        self.reference = reference

    def apply(self, logits, target_p, position_mask):
        return self.reference(logits, target_p, position_mask)


def import_specforge(path: Path, device, eager: bool) -> types.SimpleNamespace:
    sys.path.insert(0, str(path))
    stubs: dict[str, types.ModuleType] = {}
    try:
        import triton  # noqa: F401
    except ImportError:
        torch.compile(lambda x: x)  # dynamo's modules probe for triton when they load: load them before the stub exists
        stubs = _triton_stub()
    sys.modules.update(stubs)
    try:
        import specforge.core.loss as sf_loss
    finally:
        for name in stubs:
            del sys.modules[name]
    import specforge.algorithms.eagle3.model as sf_eagle3
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import TrainingBackend
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy

    if device.type != "cuda" or not hasattr(sys.modules.get("triton"), "Config"):
        sf_eagle3.LogSoftmaxLoss = _ReferenceLoss(sf_loss._compute_loss)
    if eager:
        torch._dynamo.config.disable = True
    return types.SimpleNamespace(
        path=path,
        triton_stubbed=bool(stubs),
        loss_is_reference=isinstance(sf_eagle3.LogSoftmaxLoss, _ReferenceLoss),
        eagle3=sf_eagle3,
        Draft=LlamaForCausalLMEagle3,
        TargetHead=TargetHead,
        BF16Optimizer=BF16Optimizer,
        TrainBatch=TrainBatch,
        TrainingBackend=TrainingBackend,
        TrainerCore=TrainerCore,
        Strategy=Eagle3TrainStrategy,
    )


# ---- the toy target and its features -----------------------------------------------------------
def toy_target(args, gen, device):
    """Random weights: embeddings E, a recurrence R, three aux maps and a final map, the lm_head."""
    h, v = args.hidden, args.vocab
    recurrence, _ = torch.linalg.qr(torch.randn(h, h, generator=gen))
    maps = torch.randn(4, h, h, generator=gen) / h**0.5
    head = torch.randn(v, h, generator=gen)
    # rows of equal norm, a few thousand "common" tokens louder: the argmax is not uniform over 32k
    loud = torch.ones(v)
    loud[torch.randperm(v, generator=gen)[: v // 16]] = 1.6
    head = head / head.norm(dim=1, keepdim=True) * loud[:, None] * args.logit_scale
    popularity = 1.0 / torch.arange(1, v + 1).float() ** 1.1  # Zipf, for the non-greedy tokens
    weights = {"embed": torch.randn(v, h, generator=gen), "recurrence": recurrence, "maps": maps, "head": head,
               "popularity": popularity[torch.randperm(v, generator=gen)]}  # fmt: skip
    return types.SimpleNamespace(**{name: w.to(device) for name, w in weights.items()})


def _rms(x):
    return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()


def sequences(target, n: int, seq: int, greedy: float, gen):
    """n sequences the toy target generates: ids, aux [n, seq, 3H], final [n, seq, H], top-1 ids."""
    device = target.embed.device
    ids = torch.empty(n, seq, dtype=torch.long, device=device)
    ids[:, 0] = torch.multinomial(target.popularity, n, replacement=True, generator=gen)
    state = torch.zeros(n, target.embed.shape[1], device=device)
    aux, final, top = [], [], torch.empty(n, seq, dtype=torch.long, device=device)
    for t in range(seq):
        state = _rms(target.embed[ids[:, t]] + 0.7 * state @ target.recurrence)
        aux.append(torch.cat([state @ target.maps[i] for i in range(3)], dim=-1))
        final.append(_rms(state @ target.maps[3]))
        top[:, t] = (final[-1] @ target.head.T).argmax(-1)
        if t + 1 < seq:
            sampled = torch.multinomial(target.popularity, n, replacement=True, generator=gen)
            ids[:, t + 1] = torch.where(torch.rand(n, generator=gen, device=device) < greedy, top[:, t], sampled)
    return ids, torch.stack(aux, 1), torch.stack(final, 1), top


def draft_vocab(ids, top, vocab: int, draft: int):
    """The most frequent tokens (inputs and the target's choices), ascending: d2t, t2d."""
    counts = torch.bincount(torch.cat([ids.flatten(), top.flatten()]), minlength=vocab).float()
    counts += torch.rand(vocab, device=counts.device) * 1e-3  # ties broken at random, not towards low ids
    chosen = torch.sort(counts.topk(draft).indices).values
    t2d = torch.zeros(vocab, dtype=torch.bool, device=counts.device)
    t2d[chosen] = True
    return chosen - torch.arange(draft, device=counts.device), t2d


def build_batches(args, target, gen):
    """Training batches (dicts in our collate's format) and the held-out batches with their top-1."""
    n_train = args.rounds * (args.steps + 1)
    ids, aux, final, top = sequences(target, n_train * args.batch, args.seq, 0.9, gen)
    d2t, t2d = draft_vocab(ids, top, args.vocab, args.draft_vocab)
    mask = torch.ones(args.batch, args.seq, dtype=torch.long, device=ids.device)
    mask[:, : args.seq // 8] = 0  # a prompt: not trained

    def batch(i, ids, aux, final):
        rows = slice(i * args.batch, (i + 1) * args.batch)
        return {"input_ids": ids[rows], "aux": aux[rows], "final": final[rows], "loss_mask": mask.clone(),
                "lengths": torch.full((args.batch,), args.seq, device=ids.device)}  # fmt: skip

    train = [batch(i, ids, aux, final) for i in range(n_train)]
    h_ids, h_aux, h_final, h_top = sequences(target, args.eval_batches * args.batch, args.seq, 1.0, gen)
    held = [(batch(i, h_ids, h_aux, h_final), h_top[i * args.batch : (i + 1) * args.batch]) for i in range(args.eval_batches)]
    return train, held, d2t, t2d


def drafter_config(args):
    from transformers import LlamaConfig

    from eagleops.pipeline.training.modeling.drafter_config import drafter_config_from_target

    heads = args.heads or max(1, args.hidden // 128)
    target = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.6875) // 64 * 64 or 64,
        num_hidden_layers=8,
        num_attention_heads=heads,
        num_key_value_heads=args.kv_heads or max(1, heads // 4),
        max_position_embeddings=max(4096, args.seq + args.ttt + 8),
        tie_word_embeddings=False,
    )
    return drafter_config_from_target(target, draft_vocab_size=args.draft_vocab, aux_layers=(1, 3, 4))


# ---- the two sides -----------------------------------------------------------------------------
class Side:
    """One trainer: ``step(batch)`` trains once (returns the loss), ``logits(batch)`` the draft
    logits of every TTT step without training."""

    name: str
    lm_head: object

    def step(self, batch) -> float:
        raise NotImplementedError

    def forward(self, batch) -> None:
        raise NotImplementedError

    def logits(self, batch) -> list:
        caught: list = []
        hook = self.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out.detach().float()))  # type: ignore[attr-defined]
        try:
            with torch.no_grad():
                self.forward(batch)
        finally:
            hook.remove()
        return caught


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


class SpecForgeSide(Side):
    name = "SpecForge 0.2.0"

    def __init__(self, sf, config, target, d2t, t2d, args, device, *, lr_scheduler: str = "constant", total_steps: int = 10**6):
        """``lr_scheduler``/``total_steps``: its BF16Optimizer's schedule (``cosine`` decays to 0
        over ``total_steps`` without warm-up, as ours does with ``warmup_ratio = 0``)."""
        self.sf, self.device = sf, device
        draft = sf.Draft(copy.deepcopy(config), attention_backend=args.sf_attention)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target.embed)
            draft.t2d.copy_(t2d)
            draft.d2t.copy_(d2t)
        draft.freeze_embedding()  # as its build_eagle3_draft does
        self.draft = draft.to(device)
        self.initial_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        self.model = sf.eagle3.OnlineEagle3Model(self.draft, length=args.ttt, attention_backend=args.sf_attention).to(device)
        head = sf.TargetHead.__new__(sf.TargetHead)  # its __init__ reads a checkpoint's config: the module alone
        torch.nn.Module.__init__(head)
        head.fc = torch.nn.Linear(args.hidden, args.vocab, bias=False)
        with torch.no_grad():
            head.fc.weight.copy_(target.head)
        head.freeze_weights()
        self.strategy = sf.Strategy(self.model, target_head=head.to(device), ploss_decay=0.8)
        optimizer = self.optimizer = sf.BF16Optimizer(
            self.draft,
            lr=args.lr,
            weight_decay=0.0,
            max_grad_norm=0.5,
            total_steps=total_steps,
            warmup_ratio=0.0,
            lr_scheduler=lr_scheduler,
        )

        class OneProcessBackend(sf.TrainingBackend):
            """FSDPTrainingBackend's backward and step, unwrapped (one process, no FSDP)."""

            name = "one-process"

            def prepare_model(self, model):
                return model

            def backward(self, loss, *, is_boundary=True):
                loss.backward()

            def step(self):
                return optimizer.step()

            def state_dict(self):
                return {}

            def load_state_dict(self, state):
                return None

        self.core = sf.TrainerCore(self.strategy, OneProcessBackend(), accumulation_steps=1)
        self.lm_head = self.draft.lm_head

    def _batch(self, batch):
        tensors = {
            "input_ids": batch["input_ids"],
            "attention_mask": torch.ones_like(batch["input_ids"]),
            "loss_mask": batch["loss_mask"],
            "hidden_state": batch["aux"],
            "target": batch["final"],
        }
        return self.sf.TrainBatch(sample_ids=[], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"})

    def step(self, batch) -> float:
        self.model.train()
        with _autocast(self.device):
            result = self.core.train_step(self._batch(batch))
        return float(result.loss)

    def forward(self, batch) -> None:
        self.model.eval()
        with _autocast(self.device):
            self.strategy.forward_loss(self._batch(batch))


class OursSide(Side):
    name = "ours"

    def __init__(self, config, target, d2t, t2d, initial_state, args, device):
        from eagleops.pipeline.training.modeling.drafter import Eagle3Drafter
        from eagleops.pipeline.training.train.loop import _Trainer
        from eagleops.pipeline.training.train.loss import Eagle3Objective

        drafter = Eagle3Drafter(copy.deepcopy(config))
        result = drafter.load_state_dict(initial_state, strict=False)  # the same initial weights as SpecForge's
        differ = [k for k in result.missing_keys if not k.startswith("rotary.")] + list(result.unexpected_keys)
        if differ:
            raise SystemExit(f"the draft models no longer correspond, tensors {differ}")
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.embed)
        drafter.set_vocab(d2t, t2d)
        self.drafter = drafter.to(device)
        self.objective = Eagle3Objective(
            self.drafter, target.head.float().to(device), ttt_length=args.ttt, step_weight=0.8, head_chunk=32768
        )
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        trainer = types.SimpleNamespace(
            device=device, step=0, plan=types.SimpleNamespace(position=lambda step: (0, step)), model=self.objective, optimizer=optimizer, params=params,
            tc=types.SimpleNamespace(max_grad_norm=0.5), scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        )  # fmt: skip
        self.train_step = types.MethodType(_Trainer.train_step, trainer)  # the loop's own step
        self.device = device
        self.lm_head = self.drafter.lm_head

    def step(self, batch) -> float:
        self.objective.train()
        return float(self.train_step(batch)["loss"])

    def forward(self, batch) -> None:
        self.objective.eval()
        with _autocast(self.device):
            self.objective(batch)

    def logits(self, batch) -> list:
        """Every position's draft logits at each TTT step (the objective applies the head only
        to the rows its loss reads, so they are computed here step by step, as it runs them)."""
        from eagleops.pipeline.training.modeling.blocks import DraftCache

        drafter, (ids, lengths) = self.drafter, (batch["input_ids"], batch["lengths"])
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        padding, cache, out = positions[None, :] < lengths[:, None], DraftCache.empty(), []
        with torch.no_grad(), _autocast(self.device):
            hidden = drafter.fuse(batch["aux"])
            for step in range(self.objective.ttt_length):
                tokens = torch.zeros_like(ids)
                tokens[:, : t - 1 - step] = ids[:, 1 + step :]
                hidden, logits = drafter.step(hidden, tokens, positions, step, cache, padding)
                out.append(logits.detach().float())
        return out


# ---- measuring ---------------------------------------------------------------------------------
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_round(side: Side, batches, device) -> tuple[float, float]:
    """One warm-up step, then the rest timed one synchronised step at a time: (steps/s, last loss)."""
    side.step(batches[0])
    _sync(device)
    elapsed, loss = 0.0, float("nan")
    for batch in batches[1:]:
        started = time.perf_counter()
        loss = side.step(batch)
        _sync(device)
        elapsed += time.perf_counter() - started
    return (len(batches) - 1) / elapsed, loss


def acceptance_proxy(side: Side, held, vocab, ttt: int) -> tuple[list[float], float, float]:
    """Over the held-out batches: acc_i per TTT step, tau = sum_k prod_{j<=k} acc_j, and the
    held-out loss sum_i 0.8**i CE_i (the target's distribution over the draft vocabulary against
    the draft's, averaged over the positions whose target top-1 is in the draft vocabulary),
    computed alike for both sides."""
    correct, counted, ce, ce_counted = (torch.zeros(ttt, device=vocab.d2t.device) for _ in range(4))
    for batch, top in held:
        logits = side.logits(batch)
        if len(logits) != ttt:
            raise SystemExit(f"{side.name}: {len(logits)} lm_head calls for {ttt} TTT steps")
        t = top.shape[1]
        final = batch["final"].float()
        for i, step_logits in enumerate(logits):
            step_logits = step_logits[:, : t - 1 - i]
            draft_ids = step_logits.argmax(-1)
            # position p at step i drafts the token after p + 1 + i: the target's top-1 at p + 1 + i
            truth, assistant = top[:, 1 + i :], batch["loss_mask"][:, 1 + i :].bool()
            correct[i] += ((draft_ids + vocab.d2t[draft_ids] == truth) & assistant).sum()
            counted[i] += assistant.sum()
            learnable = assistant & vocab.t2d[truth]
            q = torch.softmax(final[:, 1 + i :] @ vocab.teacher.T, dim=-1)
            ce[i] += (-(q * torch.log_softmax(step_logits, dim=-1)).sum(-1) * learnable).sum()
            ce_counted[i] += learnable.sum()
    acc = (correct / counted.clamp(min=1)).tolist()
    tau, run = 0.0, 1.0
    for a in acc:
        run *= a
        tau += run
    loss = sum(0.8**i * float(x) for i, x in enumerate(ce / ce_counted.clamp(min=1)))
    return acc, tau, loss


def profile_step(side: Side, batch, rows: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    side.step(batch)  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        side.step(batch)
    print(f"\n== profile: one step of {side.name}, top {rows} by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} CPUs)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specforge", help="unpacked SpecForge wheel (folder) or a .whl")
    parser.add_argument("--download", action="store_true", help="pip download specforge==0.2.0 into bench/_work when not found")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=None, help="default 256 on a CPU, 4096 on CUDA")
    parser.add_argument("--heads", type=int, default=0, help="attention heads (default hidden // 128)")
    parser.add_argument("--kv-heads", type=int, default=0, help="KV heads (default heads // 4)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--draft-vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--lr", type=float, default=1e-3, help="the same constant learning rate for both")
    parser.add_argument("--logit-scale", type=float, default=12.0, help="toy target's logit scale (peakiness)")
    parser.add_argument("--eval-batches", type=int, default=2, help="held-out batches for the acceptance proxy")
    parser.add_argument("--sf-attention", default="sdpa", choices=["sdpa", "flex_attention"], help="SpecForge's attention backend")
    parser.add_argument("--eager", action="store_true", help="turn SpecForge's torch.compile decorators off")
    parser.add_argument("--profile", action="store_true", help="then profile one step of each side (torch.profiler)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def setup(args):
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    )
    args.hidden = args.hidden or (4096 if device.type == "cuda" else 256)
    if args.sf_attention == "flex_attention" and device.type != "cuda":
        sys.exit("--sf-attention flex_attention: FlexAttention has no backward on a CPU; use sdpa here")
    sf = import_specforge(find_specforge(args.specforge, args.download), device, args.eager)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    target = toy_target(args, gen, device)
    # the features are made where they are trained on (a CPU run keeps the one generator)
    device_gen = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(args.seed)
    train, held, d2t, t2d = build_batches(args, target, device_gen)
    config = drafter_config(args)
    theirs = SpecForgeSide(sf, config, target, d2t, t2d, args, device)
    ours = OursSide(config, target, d2t, t2d, theirs.initial_state, args, device)
    return types.SimpleNamespace(
        device=device,
        sf=sf,
        train=train,
        held=held,
        vocab=types.SimpleNamespace(d2t=d2t, t2d=t2d, teacher=target.head[torch.arange(len(d2t), device=device) + d2t]),
        sides=(ours, theirs),
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"load at start: {_load()}", flush=True)
    bench = setup(args)
    device, sf, train, sides = bench.device, bench.sf, bench.train, bench.sides
    config = f"hidden {args.hidden}, heads {args.heads or max(1, args.hidden // 128)}, vocab {args.vocab}, draft vocab {args.draft_vocab}"
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads; {config}, seq {args.seq}, batch {args.batch}, "
          f"TTT {args.ttt}, lr {args.lr}; SpecForge from {sf.path} (triton stubbed: {sf.triton_stubbed}, "
          f"loss: {'reference _compute_loss' if sf.loss_is_reference else 'Triton LogSoftmaxLoss'}, attention {args.sf_attention}, "
          f"compile {'off' if args.eager else 'on'})", flush=True)  # fmt: skip
    before = {side.name: acceptance_proxy(side, bench.held, bench.vocab, args.ttt) for side in sides}
    rates: dict[str, list[float]] = {side.name: [] for side in sides}
    losses: dict[str, float] = {}
    per_round = args.steps + 1
    for r in range(args.rounds):
        batches = train[r * per_round : (r + 1) * per_round]
        for side in sides:  # A, B, A, B ...: drift in the machine's load hits both alike
            rate, losses[side.name] = timed_round(side, batches, device)
            rates[side.name].append(rate)
            print(f"round {r + 1}: {side.name:16s} {rate:7.3f} steps/s  loss {losses[side.name]:.4f}", flush=True)
    after = {side.name: acceptance_proxy(side, bench.held, bench.vocab, args.ttt) for side in sides}
    report(sides, rates, losses, before, after, args)
    if args.profile:
        for side in sides:
            profile_step(side, train[-1])
    print(f"load at end: {_load()}", flush=True)


def report(sides, rates, losses, before, after, args) -> None:
    ours_rate = statistics.median(rates[sides[0].name])
    print(
        f"\n{'side':16s} {'steps/s':>8s} {'ratio':>6s} {'tok/s':>7s} {'train loss':>10s} {'held-out loss':>15s} {'tau':>15s}  acc_i at end"
    )
    for side in sides:
        rate, (_, tau0, ce0), (accs, tau1, ce1) = statistics.median(rates[side.name]), before[side.name], after[side.name]
        print(f"{side.name:16s} {rate:8.3f} {ours_rate / rate:6.3f} {rate * args.batch * args.seq:7.0f} {losses[side.name]:10.4f} "
              f"{ce0:6.3f} -> {ce1:6.3f} {tau0:6.4f} -> {tau1:6.4f}  {' '.join(f'{a:.3f}' for a in accs)}")  # fmt: skip
    print("steps/s: median over rounds; ratio: ours / this side; train loss: each side's own last weighted TTT loss (SpecForge")
    print("averages over all batch x seq positions, ours over the trained ones: the scales differ); held-out loss (sum_i 0.8**i CE_i)")
    print("and tau (sum_k prod_{j<=k} acc_j): computed alike for both, before -> after training.")


if __name__ == "__main__":
    main()
