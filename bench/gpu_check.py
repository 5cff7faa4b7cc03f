"""The GPU check: extract and train at a realistic hidden size on whatever accelerator is here, in
bf16 where it is supported, plus the NVML reader on a real GPU. Prints tokens/s, MFU and every
failure with its traceback (one part failing does not stop the others). Random weights: no hub.

    python bench/gpu_check.py [--hidden 4096] [--layers 4] [--tokens 16384] [--steps 20]

`bench/gpu_check.sh` runs it on a lent GPU machine; `--hidden 64 --layers 4 --tokens 512
--steps 3` runs the same code on a CPU (the tests do that, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12, "GB200": 2500e12, "B200": 2250e12}


def _peak(name: str) -> float | None:
    return next((flops for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if key in name), None)


def _part(title: str, run) -> object:
    print(f"\n== {title}", flush=True)
    try:
        return run()
    except Exception:
        print(f"FAILED: {title}\n{traceback.format_exc()}", flush=True)
        return None


def check_nvml() -> None:
    from eagleops.pipeline.engine.telemetry import NvmlReader

    stats = NvmlReader().read()
    if stats.error:
        print(f"NVML: {stats.error}")
    for gpu in stats.gpus:
        print(f"NVML: {gpu}")


def build_target(args, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, args.hidden // 128)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.6875) // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.eval().requires_grad_(False)
    return model, config


def check_extract(args, model, device, dtype):
    import torch

    from eagleops.pipeline.training.extract.hf import forward_features
    from eagleops.pipeline.training.modeling.layers import default_aux_layers

    aux_layers = default_aux_layers(args.layers)
    batch = max(1, args.tokens // args.seq)
    ids = [torch.randint(0, args.vocab, (args.seq,)) for _ in range(batch)]
    forward_features(model, ids[:1], aux_layers, device, dtype)  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    aux, final = forward_features(model, ids, aux_layers, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = batch * args.seq
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    flops = 2 * params * tokens
    print(f"extract: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:,.0f} tokens/s; aux {tuple(aux.shape)} {aux.dtype}")
    _mfu(flops / seconds)
    if device.type == "cuda":
        print(f"extract: peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    # clone: extract's tensors are inference-mode tensors, which autograd may not save
    return aux_layers, aux.reshape(-1, aux.shape[-1])[: args.seq * 2].clone(), final.reshape(-1, final.shape[-1])[: args.seq * 2].clone()


def _mfu(flops_per_s: float) -> None:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = _peak(name)
    share = f"MFU {100 * flops_per_s / peak:.1f}% of {name}'s {peak / 1e12:.0f} TFLOPS bf16" if peak else f"(no peak known for {name})"
    print(f"         {flops_per_s / 1e12:.2f} TFLOPS achieved; {share}")


def _drafter_and_objective(args, model, config, aux_layers, device):
    """A drafter over a random draft vocabulary with the target's embeddings, and its TTT objective."""
    import torch

    from eagleops.pipeline.training.modeling.drafter import Eagle3Drafter
    from eagleops.pipeline.training.modeling.drafter_config import drafter_config_from_target
    from eagleops.pipeline.training.train.loss import Eagle3Objective

    draft = min(args.draft_vocab, args.vocab)
    drafter = Eagle3Drafter(drafter_config_from_target(config, draft_vocab_size=draft, aux_layers=aux_layers)).to(device)
    chosen = torch.sort(torch.randperm(args.vocab)[:draft]).values
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[chosen] = True
    drafter.set_vocab((chosen - torch.arange(draft)).to(device), t2d.to(device))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
    objective = Eagle3Objective(drafter, model.lm_head.weight.detach().float(), ttt_length=args.ttt, step_weight=0.8, head_chunk=32768)
    return drafter, objective


def check_train(args, model, config, aux_layers, aux, final, device, dtype):
    import torch

    drafter, objective = _drafter_and_objective(args, model, config, aux_layers, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    seq = args.seq
    batch = {
        "input_ids": torch.randint(0, args.vocab, (2, seq), device=device),
        "aux": aux[: 2 * seq].reshape(2, seq, -1).to(device),
        "final": final[: 2 * seq].reshape(2, seq, -1).to(device),
        "loss_mask": torch.ones((2, seq), dtype=torch.long, device=device),
        "lengths": torch.full((2,), seq, device=device),
    }
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    losses, started = [], None
    for step in range(args.steps + 1):
        if step == 1:  # the first step compiles kernels: not timed
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        with autocast:
            loss, _, accs = objective(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        losses.append(float(loss.detach()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - (started or time.perf_counter())
    tokens = 2 * seq * args.steps
    print(f"train: {args.steps} steps of 2x{seq} tokens, TTT {args.ttt}, in {seconds:.3f} s = {tokens / seconds:,.0f} tokens/s")
    print(f"train: loss {losses[0]:.4f} -> {losses[-1]:.4f} (random features: it should still fall)")
    if device.type == "cuda":
        print(f"train: peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


def check_fused_attention(args, model, config, aux_layers, aux, final, device, dtype):
    """The TTT attention's fused (flex_attention) and eager paths: the same loss and gradients."""
    import torch

    from eagleops.pipeline.training.modeling import drafter as drafter_module

    torch.manual_seed(1)
    drafter, objective = _drafter_and_objective(args, model, config, aux_layers, device)
    seq = args.seq
    lengths = torch.tensor([seq, seq - 300], device=device)
    batch = {
        "input_ids": torch.randint(0, args.vocab, (2, seq), device=device),
        "aux": aux[: 2 * seq].reshape(2, seq, -1).to(device),
        "final": final[: 2 * seq].reshape(2, seq, -1).to(device),
        "loss_mask": (torch.arange(seq, device=device)[None, :] < lengths[:, None]).long(),
        "lengths": lengths,
    }
    results = {}
    for fused in (False, True):
        drafter_module.Attention.fused = fused
        drafter.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _, _ = objective(batch)
        loss.backward()
        results[fused] = (float(loss.detach()), torch.cat([p.grad.flatten().float() for p in drafter.parameters() if p.grad is not None]))
        timed = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss, _, _ = objective(batch)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed.append(time.perf_counter() - started)
        print(f"{'fused' if fused else 'eager'} attention: loss {results[fused][0]:.5f}, forward+backward {min(timed) * 1000:.0f} ms")
    drafter_module.Attention.fused = True
    (eager_loss, eager_grad), (fused_loss, fused_grad) = results[False], results[True]
    relative = float((fused_grad - eager_grad).norm() / eager_grad.norm().clamp(min=1e-12))
    print(f"fused vs eager: loss {fused_loss - eager_loss:+.2e}, gradient relative difference {relative:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ttt", type=int, default=7)
    args = parser.parse_args()
    args.seq = min(args.seq, args.tokens)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, device {device} ({name}), dtype {dtype}, hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}"
    )
    _part("NVML", check_nvml)
    built = _part("target (random weights)", lambda: build_target(args, device, dtype))
    if built is None:
        sys.exit(1)
    model, config = built
    extracted = _part("extract", lambda: check_extract(args, model, device, dtype))
    if extracted is not None:
        _part("train", lambda: check_train(args, model, config, *extracted, device, dtype))
        _part("TTT attention: fused against eager", lambda: check_fused_attention(args, model, config, *extracted, device, dtype))
    print("\ngpu_check: done", flush=True)


if __name__ == "__main__":
    main()
