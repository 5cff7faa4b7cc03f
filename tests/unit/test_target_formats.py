"""Every trained span is what the target emitted: for each real target of the zoo, in each thinking
mode, for one reply, for every reply of a regenerated conversation, and after a tool call.

What each model emits is written here by hand, from its model card and its reasoning parser (the
ground truth the code must reach by itself; the code reads no model name):

* Qwen3 writes its thinking block itself after ``<|im_start|>assistant\\n``;
* Kimi-K2.5's and DeepSeek-V3.1's generation prompts open ``<think>``: they write only the rest;
* Kimi-K2-Thinking's prompt opens nothing: it writes ``<think>`` itself;
* gpt-oss writes harmony channels, analysis then final, ending with ``<|return|>``;
* Llama-3.1 does not think.
"""

from __future__ import annotations

import pytest

from tests.conftest import builder_for, trained_spans
from tests.zoo.build import ZOO

R, C = "Two plus two is four.", "It is 4."
R2, C2 = "Three more makes seven.", "Seven."
KEEP = {  # the reply as each target emits it, thinking R then answer C
    "qwen3-8b": "<think>\n{r}\n</think>\n\n{c}<|im_end|>",
    "kimi-k2.5": "{r}</think>{c}<|im_end|>",
    "kimi-k2-thinking": "<think>{r}</think>{c}<|im_end|>",
    "deepseek-v3.1": "{r}</think>{c}<｜end▁of▁sentence｜>",
    "gpt-oss-20b": "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>{c}<|return|>",
}
OFF = {  # the reply with thinking off (after the prompt in the template's own off words)
    "qwen3-8b": "{c}<|im_end|>",
    "kimi-k2.5": "{c}<|im_end|>",
    "kimi-k2-thinking": "<think></think>{c}<|im_end|>",  # no switch: it writes an empty block
    "deepseek-v3.1": "{c}<｜end▁of▁sentence｜>",
    "gpt-oss-20b": "<|channel|>final<|message|>{c}<|return|>",  # low effort, no analysis written
    "llama-3.1-8b-instruct": "{c}<|eot_id|>",
}
END = {  # the answer's end as emitted (drop trains only the answer and this)
    "qwen3-8b": "<|im_end|>",
    "kimi-k2.5": "<|im_end|>",
    "kimi-k2-thinking": "<|im_end|>",
    "deepseek-v3.1": "<｜end▁of▁sentence｜>",
    "gpt-oss-20b": "<|return|>",
    "llama-3.1-8b-instruct": "<|eot_id|>",
}
PROMPT_ENDS = {  # the generation prompt each mode renders, as the server did
    ("qwen3-8b", "keep"): "<|im_start|>assistant\n",
    ("qwen3-8b", "off"): "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ("kimi-k2.5", "keep"): "<|im_assistant|>assistant<|im_middle|><think>",
    ("kimi-k2.5", "off"): "<|im_assistant|>assistant<|im_middle|><think></think>",
    ("deepseek-v3.1", "keep"): "<｜Assistant｜><think>",  # V3.1 thinks only when asked
    ("deepseek-v3.1", "off"): "<｜Assistant｜></think>",
    ("gpt-oss-20b", "keep"): "<|start|>assistant",
}
THINKERS = sorted(KEEP)


@pytest.fixture(scope="module")
def builders(zoo_files):
    from transformers import AutoTokenizer

    made = {}

    def builder(target: str):
        if target not in made:
            model = "kimi-k2.5" if target.startswith("kimi") else target
            folder = zoo_files(model)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=model.startswith("kimi"))
            if target == "kimi-k2-thinking":  # its own template over the K2 family's tokenizer
                tokenizer.chat_template = (ZOO / target / "chat_template.jinja").read_text()
            made[target] = builder_for(tokenizer, folder)
        return made[target]

    return builder


def _one(thought: str | None = R) -> list[dict]:
    reply = {"role": "assistant", "content": C} | ({"reasoning_content": thought} if thought else {})
    return [{"role": "user", "content": "What is 2+2?"}, reply]


def _two() -> list[dict]:
    return [
        *_one(),
        {"role": "user", "content": "And three more?"},
        {"role": "assistant", "content": C2, "reasoning_content": R2},
    ]


CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def _after_tool() -> list[dict]:
    """Another model's tool call (history), its result, then the target's answer."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "rain, 7C"},
        {"role": "assistant", "content": C, "reasoning_content": R},
    ]


def _spans(builder, samples) -> list[str]:
    return [span for s in samples for span in trained_spans(builder.tokenizer, s.ids, s.mask)]


def _check(builder, samples, mode: str) -> None:
    from eagleops.pipeline.training.prepare.check import trained_problems

    for sample in samples:
        assert trained_problems(builder.tokenizer, sample, mode, builder.stop_ids) == []


# ---- 4. kept thinking is trained in the format the target writes ------------------------------


@pytest.mark.parametrize("target", THINKERS)
def test_kept_thinking_is_trained_as_the_target_writes_it(builders, target):
    b = builders(target)
    samples = b.build(_one(), [1], "keep")
    assert _spans(b, samples) == [KEEP[target].format(r=R, c=C)]
    _check(b, samples, "keep")
    if (target, "keep") in PROMPT_ENDS:
        reply = samples[0].replies[0]
        assert b.tokenizer.decode(samples[0].ids[: reply.start]).endswith(PROMPT_ENDS[(target, "keep")])


@pytest.mark.parametrize("target", THINKERS)
def test_every_regenerated_reply_is_trained_as_written(builders, target):
    b = builders(target)
    samples = b.build(_two(), [1, 3], "keep")
    assert sorted(_spans(b, samples)) == sorted([KEEP[target].format(r=R, c=C), KEEP[target].format(r=R2, c=C2)])
    _check(b, samples, "keep")


# Templates that concatenate a tool call's ``arguments`` as text: vLLM and SGLang hand them an
# object (``as_engine_renders``), so the engine itself cannot render a conversation with a tool
# call in its history (tests/unit/test_engine_messages.py checks that against vLLM's own function)
NEEDS_TEXT_ARGUMENTS = {"deepseek-v3.1"}


@pytest.mark.parametrize("target", THINKERS)
def test_a_reply_after_a_tool_result_is_trained_as_written(builders, target):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    b = builders(target)
    if target in NEEDS_TEXT_ARGUMENTS:
        with pytest.raises(PrepareError, match=r"arguments parsed into objects\): can only concatenate str \(not \"dict\"\)"):
            b.build(_after_tool(), [4], "keep")
        return
    samples = b.build(_after_tool(), [4], "keep")
    assert _spans(b, samples) == [KEEP[target].format(r=R, c=C)]
    assert "rain, 7C" in b.tokenizer.decode(samples[0].ids)


def test_llama_cannot_show_kept_thinking_and_says_what_to_do(builders):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    with pytest.raises(PrepareError, match='turn 1: the chat template shows no thinking.*thinking = "drop"'):
        builders("llama-3.1-8b-instruct").build(_one(), [1], "keep")


# ---- 5. drop and off, multi-turn, train nothing the target did not write ---------------------


@pytest.mark.parametrize("target", [*THINKERS, "llama-3.1-8b-instruct"])
@pytest.mark.parametrize("conversation", ["one", "two", "tool"])
def test_dropped_thinking_is_context_never_trained(builders, target, conversation):
    if conversation == "tool" and target in NEEDS_TEXT_ARGUMENTS:
        pytest.skip("the engine cannot render this conversation for this template (test_a_reply_after_a_tool_result...)")
    b = builders(target)
    messages, trained, answers = {"one": (_one(), [1], [C]), "two": (_two(), [1, 3], [C, C2]), "tool": (_after_tool(), [4], [C])}[
        conversation
    ]
    samples = b.build(messages, trained, "drop")
    assert sorted(_spans(b, samples)) == sorted(f"{c}{END[target]}" for c in answers)
    _check(b, samples, "drop")
    if target != "llama-3.1-8b-instruct":  # the answer was written after the thinking: it stays
        assert R in b.tokenizer.decode(samples[0].ids) or R2 in b.tokenizer.decode(samples[-1].ids)


@pytest.mark.parametrize("target", sorted(OFF))
@pytest.mark.parametrize("conversation", ["one", "two"])
def test_thinking_off_trains_the_answer_after_the_templates_own_off_prompt(builders, target, conversation):
    b = builders(target)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in (_one() if conversation == "one" else _two())]
    trained = [1] if conversation == "one" else [1, 3]
    samples = b.build(plain, trained, "off")
    assert sorted(_spans(b, samples)) == sorted(OFF[target].format(c=c) for c in ([C] if conversation == "one" else [C, C2]))
    _check(b, samples, "off")
    if (target, "off") in PROMPT_ENDS:
        reply = samples[0].replies[0]
        assert b.tokenizer.decode(samples[0].ids[: reply.start]).endswith(PROMPT_ENDS[(target, "off")])


# ---- 7. drop with the server's exact ids does not train the dropped thinking ------------------


@pytest.mark.parametrize("target", THINKERS)
def test_drop_with_the_servers_ids_trains_only_the_answer(builders, target):
    b = builders(target)
    emitted = b.tokenizer.encode(KEEP[target].format(r=R, c=C), add_special_tokens=False)
    samples = b.build(_one(), [1], "drop", exact=emitted)
    assert samples[0].ids[-len(emitted) :] == emitted  # the server's ids, thinking included
    assert _spans(b, samples) == [f"{C}{END[target]}"]
    kept = b.build(_one(), [1], "keep", exact=emitted)
    assert _spans(b, kept) == [KEEP[target].format(r=R, c=C)]


# ---- 8. half-tagged inline thinking never stays in the answer ---------------------------------


@pytest.mark.parametrize(
    ("content", "reasoning", "answer", "thought"),
    [
        ("<think>weigh it</think>\n\nIt is 4.", None, "It is 4.", "weigh it"),
        ("weigh it</think>It is 4.", None, "It is 4.", "weigh it"),  # R1 / V3.1: the prompt opened it
        ("<think>weigh it and then", None, "", "weigh it and then"),  # cut at max_tokens mid-thought
        ("<think>a <think>b</think> c</think>It is 4.", None, "It is 4.", "a b c"),  # nested
        ("<think>more</think>It is 4.", "weigh it", "It is 4.", "weigh it\n\nmore"),  # field and inline
        ("no tags, It is 4.", "weigh it", "no tags, It is 4.", "weigh it"),
        ("It is 4.", None, "It is 4.", None),
    ],
)
def test_inline_thinking_is_split_from_the_answer_in_every_form(content, reasoning, answer, thought):
    from eagleops.pipeline.formats.thinking import split_thinking

    assert split_thinking(content, reasoning) == (answer, thought)


@pytest.mark.parametrize("mode", ["drop", "off"])
def test_half_tagged_thinking_in_a_stored_answer_is_not_trained(builders, mode):
    """Records written by a server without a reasoning parser (or by an older eagleops) hold
    the thinking in the content: prepare splits it too."""
    b = builders("qwen3-8b")
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": f"{R}</think>\n\n{C}"}]
    samples = b.build(messages, [1], "drop")
    assert _spans(b, samples) == [f"{C}<|im_end|>"]
    cut = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": f"<think>{R}"}]
    assert _spans(b, b.build(cut, [1], mode, finished=False)) == []  # nothing but thinking: nothing trained


def test_a_reply_cut_while_thinking_is_trained_without_a_close_or_an_end(builders):
    b = builders("qwen3-8b")
    cut = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "", "reasoning_content": R}]
    assert _spans(b, b.build(cut, [1], "keep", finished=False)) == [f"<think>\n{R}"]


# ---- a regenerated chat keeps every reply's ids from the server ------------------------------


async def test_a_regenerated_chat_records_every_replys_ids():
    from eagleops.pipeline.generate.client import Completion
    from eagleops.pipeline.generate.conversation import regenerate_all
    from eagleops.pipeline.generate.records import generated_record
    from eagleops.pipeline.sources import Prompt

    class Client:
        calls = 0

        async def complete(self, messages, thinking, **kwargs):
            Client.calls += 1
            ids = (10 * Client.calls, 10 * Client.calls + 1)
            return Completion(f"answer {Client.calls}", "stop", 5, 2, "server", "e", 0.1, 1, token_ids=ids)

    turns = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "old"}, {"role": "user", "content": "b"})
    conversation, completion, written = await regenerate_all(Client(), turns, "keep")
    record = generated_record(Prompt("p", turns, 0, 1, 1), "D", conversation, completion, written, model="m", thinking="keep")
    assert record["target_turns"] == [1, 3] and record["reply_token_ids"] == [[10, 11], [20, 21]]
    assert record["completion_token_ids"] == [20, 21]


@pytest.mark.parametrize("target", THINKERS)
def test_every_reply_of_a_regenerated_chat_is_trained_on_the_servers_ids(builders, target):
    b = builders(target)
    emitted = {k: b.tokenizer.encode(KEEP[target].format(r=r, c=c), add_special_tokens=False) for k, r, c in ((1, R, C), (3, R2, C2))}
    samples = b.build(_two(), [1, 3], "drop", exact_turns=emitted)
    assert all(reply.exact for s in samples for reply in s.replies)
    assert sorted(_spans(b, samples)) == sorted([f"{C}{END[target]}", f"{C2}{END[target]}"])


@pytest.mark.parametrize("target", ["qwen3-8b", "kimi-k2.5", "deepseek-v3.1"])
@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_the_check_reads_a_reply_as_the_server_decoded_it(builders, target, mode):
    """A sampled model can write a thinking tag again in its answer or mid-thought; the ids are
    what it wrote, while vLLM's reasoning parser strips those tags from the text it returns.
    The check on the first samples compares the text as the server decoded it, not only our
    decoding: before, one such reply among a dataset's first eight stopped prepare (CI)."""
    from eagleops.pipeline.training.prepare.check import trained_problems

    b = builders(target)
    wrote_thought, wrote_answer = "Two <think>plus two", "It is</think> 4."
    emitted = b.tokenizer.encode(KEEP[target].format(r=wrote_thought, c=wrote_answer), add_special_tokens=False)
    as_served = {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two"}
    samples = b.build([{"role": "user", "content": "What is 2+2?"}, as_served], [1], mode, exact=emitted)
    assert samples[0].ids[-len(emitted) :] == emitted
    for sample in samples:
        assert trained_problems(b.tokenizer, sample, mode, b.stop_ids) == []
