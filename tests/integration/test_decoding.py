"""Eval's decoding with KV caches (``pipeline/training/eval/decoding.py``): the same tokens as
the uncached computation, through the language model of any target (a wrapper without
``generate`` included), at a cost that grows with the tokens decoded."""

from __future__ import annotations

import pytest
import torch

from eagleops.pipeline.training.modeling.blocks import DraftCache
from eagleops.pipeline.training.modeling.drafter import Eagle3Drafter


def _drafter(seed: int = 0, **extra) -> Eagle3Drafter:
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=50, draft_vocab_size=20, target_hidden_size=24, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip
    drafter = Eagle3Drafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    drafter.set_vocab(torch.arange(20) * 2 - torch.arange(20), torch.zeros(50, dtype=torch.bool))
    return drafter.eval()


def _uncached_chain(drafter: Eagle3Drafter, aux: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """The chain drafted from scratch over the whole context, as eval did before it had a cache."""
    positions = torch.arange(aux.shape[1])
    cache = DraftCache.empty()
    hidden, logits = drafter.step(drafter.fuse(aux), torch.tensor([tokens]), positions, 0, cache)
    hidden, logits = hidden[:, -1:], logits[:, -1:]
    drafts = []
    for i in range(k):
        draft = int(logits[0, -1].argmax())
        drafts.append(draft + int(drafter.d2t[draft]))
        if i + 1 < k:
            hidden, logits = drafter.step(hidden, torch.tensor([[drafts[-1]]]), positions[-1:], i + 1, cache)
    return drafts


@pytest.mark.parametrize("kind", ["eagle3", "eagle3.1"])
def test_a_session_drafts_what_a_pass_over_the_whole_context_drafts(kind):
    """The context grows by a few accepted tokens at a time; each chain equals the chain drafted
    from scratch over the whole context, and drafting leaves the cache as it found it."""
    drafter = _drafter(fc_norm=kind == "eagle3.1", norm_output=kind == "eagle3.1")
    generator = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 40, 72, generator=generator)
    tokens = torch.randint(0, 50, (40,), generator=generator).tolist()
    session = drafter.session()
    grown = 0
    for step in (7, 1, 3, 5, 2, 4):
        session.extend(aux[:, grown : grown + step], tokens[grown : grown + step])
        grown += step
        assert session.propose(4) == _uncached_chain(drafter, aux[:, :grown], tokens[:grown], 4)
        assert len(session.cache.keys) == 1 and session.cache.keys[0].shape[2] == grown


def test_an_mla_session_drafts_what_a_pass_over_the_whole_context_drafts():
    drafter = _drafter(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    generator = torch.Generator().manual_seed(4)
    aux = torch.randn(1, 20, 72, generator=generator)
    tokens = torch.randint(0, 50, (20,), generator=generator).tolist()
    session = drafter.session()
    session.extend(aux[:, :12], tokens[:12])
    session.extend(aux[:, 12:], tokens[12:])
    assert session.propose(3) == _uncached_chain(drafter, aux, tokens, 3)


def _tiny_target(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def test_cached_target_gives_the_uncached_features_and_greedy_tokens(tiny_model):
    """Fed in pieces through its cache, with drafts cut back: the features and the greedy next
    tokens of one uncached forward over the same sequence."""
    from eagleops.pipeline.training.eval.decoding import CachedTarget

    model = _tiny_target(tiny_model)
    ids = torch.randint(5, 200, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    layers = (1, 2, 3)
    expected_aux = torch.cat([whole.hidden_states[i + 1] for i in layers], dim=-1)
    target = CachedTarget(model, layers, "cpu")
    aux, greedy = target.feed(ids[:10])
    pieces, choices = [aux], greedy
    aux, greedy = target.feed([*ids[10:14], 7, 7, 7])  # three drafts the target then refuses
    target.crop(14)
    pieces.append(aux[:, :4])
    choices += greedy[:4]
    aux, greedy = target.feed(ids[14:])
    pieces.append(aux)
    choices += greedy
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected_aux, rtol=1e-4, atol=1e-4)
    assert choices == whole.logits[0].argmax(-1).tolist()


def test_speculative_decoding_gives_the_greedy_output(tiny_model):
    """Whatever the drafter proposes, greedy verification keeps the target's greedy tokens (fp32:
    no near-ties to split), and each step gains its accepted drafts plus one."""
    from eagleops.pipeline.training.eval.decoding import CachedTarget, greedy_generate, speculative_generate

    model = _tiny_target(tiny_model)
    hidden = model.config.hidden_size
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        vocab_size=model.config.vocab_size, draft_vocab_size=model.config.vocab_size, target_hidden_size=hidden, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).eval()
    target = CachedTarget(model, (1, 2, 3), "cpu")
    for prompt in ([1, 40, 41, 42, 43], [1, 90, 12]):
        plain = greedy_generate(target, prompt, 40, stops=set())
        generated, accepted = speculative_generate(target, drafter, prompt, k=3, max_new_tokens=40, stops=set())
        assert generated == plain and len(plain) == 40
        assert sum(a + 1 for a in accepted) >= 40 and all(0 <= a <= 3 for a in accepted)


def test_eval_decodes_a_wrapper_that_has_no_generate(zoo_model):
    """Kimi-K2.5's remote-code wrapper does not inherit GenerationMixin, so it has no
    ``generate`` (transformers >= 4.50): eval decodes through its language model all the same."""
    from transformers import AutoModelForCausalLM

    from eagleops.pipeline.training.eval.decoding import CachedTarget, greedy_generate

    folder = zoo_model("kimi-k2.5")
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()
    assert not hasattr(model, "generate")
    target = CachedTarget(model, (1, 3, 4), "cpu")
    prompt = [163584, 100, 200, 300]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits
    out = greedy_generate(target, prompt, 6, stops=set())
    assert out[0] == int(logits[0, -1].argmax()) and len(out) == 6
