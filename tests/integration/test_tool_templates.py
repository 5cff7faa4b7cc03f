"""Tool calls trained as each target writes them: every zoo template that renders tool calls, in
every thinking mode it supports, over multi-turn conversations with parallel calls and their
several results.

What each model writes is set down here by hand, from its model card and its chat template (the
text the template gives an assistant turn is the format the model was trained to emit), never from
eagleops' output:

* Qwen3 (Hermes style): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, calls
  separated by a newline, after its thinking block;
* Qwen3-Thinking-2507: the same calls; its generation prompt opens ``<think>\\n``, so it writes
  only the rest of its thinking, then ``\\n</think>\\n\\n``; it has no switch to stop thinking;
* Qwen3-Coder: ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n...`` (XML, one
  parameter per argument, a string raw, a number as written), no thinking;
* Mistral-Small-3.2: ``[TOOL_CALLS]N[CALL_ID]id[ARGS]{...}`` per call (nine-character ids), then
  ``</s>``; no thinking, no generation prompt;
* Kimi-K2.5 and K2-Thinking: ``<|tool_calls_section_begin|>`` and one ``<|tool_call_begin|>id
  <|tool_call_argument_begin|>{...}<|tool_call_end|>`` per call, after ``</think>``;
* gpt-oss: one call a reply, after its analysis: ``<|start|>assistant<|channel|>commentary
  to=functions.N <|constrain|>json<|message|>{...}<|call|>`` (OpenAI's harmony guide). Its template
  renders a call in the history in another form (``<|start|>assistant to=functions.N<|channel|>
  commentary json<|message|>``), so only the server's ids say what it wrote: its calls are tested
  with them;
* Llama-3.1: one call per reply, ``{"name": N, "parameters": {...}}<|eot_id|>``;
* DeepSeek-V3.1 concatenates ``arguments`` as text: it cannot render the objects vLLM and SGLang
  give it (tests/unit/test_engine_messages.py), nor can prepare.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from tests.conftest import builder_for, trained_spans
from tests.zoo.build import ZOO

# target -> (the zoo folder of its tokenizer, the template-only folder of its template, if another)
TARGETS = {
    "qwen3-8b": ("qwen3-8b", None),
    "qwen3-thinking-2507": ("qwen3-8b", "qwen3-thinking-2507"),
    "qwen3-coder-30b-a3b": ("qwen3-8b", "qwen3-coder-30b-a3b"),
    "mistral-small-3.2": ("mistral-small-3.2", None),
    "kimi-k2.5": ("kimi-k2.5", None),
    "kimi-k2-thinking": ("kimi-k2.5", "kimi-k2-thinking"),
    "gpt-oss-20b": ("gpt-oss-20b", None),
    "llama-3.1-8b-instruct": ("llama-3.1-8b-instruct", None),
    "deepseek-v3.1": ("deepseek-v3.1", None),
}
REMOTE_CODE = {"kimi-k2.5"}
# the templates added for these tests, byte for byte as SOURCE.md records them (sha256)
VERBATIM = {
    "qwen3-coder-30b-a3b": "5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06",
    "qwen3-thinking-2507": "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
    "mistral-small-3.2": "5b8f31f11198696548d544dbe424a3c1ef244d00a475f4e1bffb351fda085608",
}

R1, R2, R3, R4 = "Both tools, at once.", "Summarise both.", "One forecast call.", "Answer briefly."
A2, A4 = "Rainy, 7C at 14:05.", "Sunny, 12C for three days."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
        },
    }
    for name, description in (("get_weather", "Weather now"), ("get_time", "Local time"), ("get_forecast", "Forecast"))
]
# (name, arguments as the server returns them: JSON text)
OSLO = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"city": "Oslo"}')]
BERGEN = [("get_forecast", '{"city": "Bergen", "days": 3}')]
# the call ids each target writes: Kimi numbers its calls, Mistral's are nine characters (the
# other templates do not show ids)
CALL_IDS = {"kimi": ["functions.get_weather:0", "functions.get_time:1", "functions.get_forecast:2"]}
NINE_CHARACTER_IDS = ["a1b2c3d4e", "f5g6h7i8j", "k9l0m1n2o"]

# ---- what each target writes (from its model card and template, not from eagleops) -------------

HERMES_OSLO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
)
HERMES_BERGEN = '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Bergen", "days": 3}}\n</tool_call><|im_end|>'
KIMI_OSLO = (
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
)
KIMI_BERGEN = (
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_forecast:2<|tool_call_argument_begin|>{"city": "Bergen", "days": 3}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
)
# (the first call turn, the second), each with its turn end; None: the target writes one call a reply
CALLS_WRITTEN = {
    "qwen3-8b": (HERMES_OSLO, HERMES_BERGEN),
    "qwen3-thinking-2507": (HERMES_OSLO, HERMES_BERGEN),
    "qwen3-coder-30b-a3b": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "<tool_call>\n<function=get_forecast>\n<parameter=city>\nBergen\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
    ),
    "mistral-small-3.2": (
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]f5g6h7i8j[ARGS]{"city": "Oslo"}</s>',
        '[TOOL_CALLS]get_forecast[CALL_ID]k9l0m1n2o[ARGS]{"city": "Bergen", "days": 3}</s>',
    ),
    "kimi-k2.5": (KIMI_OSLO, KIMI_BERGEN),
    "kimi-k2-thinking": (KIMI_OSLO, KIMI_BERGEN),
    "llama-3.1-8b-instruct": (None, '{"name": "get_forecast", "parameters": {"city": "Bergen", "days": 3}}<|eot_id|>'),
}
ANSWER_WRITTEN = {  # a plain answer {a}, its turn end included
    "qwen3-8b": "{a}<|im_end|>",
    "qwen3-thinking-2507": "{a}<|im_end|>",
    "qwen3-coder-30b-a3b": "{a}<|im_end|>",
    "mistral-small-3.2": "{a}</s>",
    "kimi-k2.5": "{a}<|im_end|>",
    "kimi-k2-thinking": "{a}<|im_end|>",
    "gpt-oss-20b": "<|channel|>final<|message|>{a}<|return|>",
    "llama-3.1-8b-instruct": "{a}<|eot_id|>",
}
# what comes before {c} (the calls or the answer above) in each thinking mode the template
# supports; {r}: the thinking. Only keep trains the thinking; drop keeps it as context.
WRITES = {
    "qwen3-8b": {"keep": "<think>\n{r}\n</think>\n\n{c}", "drop": "{c}", "off": "{c}"},
    "qwen3-thinking-2507": {"keep": "{r}\n</think>\n\n{c}", "drop": "{c}"},  # off: refused (below)
    "qwen3-coder-30b-a3b": {"keep": "{c}", "drop": "{c}", "off": "{c}"},  # does not think
    "mistral-small-3.2": {"keep": "{c}", "drop": "{c}", "off": "{c}"},  # does not think
    "kimi-k2.5": {"keep": "{r}</think>{c}", "drop": "{c}", "off": "{c}"},
    "kimi-k2-thinking": {"keep": "<think>{r}</think>{c}", "drop": "{c}", "off": "<think></think>{c}"},  # no switch: an empty block
    "llama-3.1-8b-instruct": {"keep": "{c}", "drop": "{c}", "off": "{c}"},  # does not think
}
THINKERS = {"qwen3-8b", "qwen3-thinking-2507", "kimi-k2.5", "kimi-k2-thinking"}
CASES = [(target, mode) for target, modes in WRITES.items() for mode in modes]
# Llama-3.1 writes one call a reply (its template refuses more: tested below)
PARALLEL_CASES = [(target, mode) for target, mode in CASES if CALLS_WRITTEN[target][0] is not None]


@pytest.fixture(scope="module")
def builders(zoo_files):
    from transformers import AutoTokenizer

    made = {}

    def builder(target: str):
        if target not in made:
            source, template = TARGETS[target]
            folder = zoo_files(source)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=source in REMOTE_CODE)
            if template:  # a template-only entry, over the tokenizer of its family
                tokenizer.chat_template = (ZOO / template / "chat_template.jinja").read_text()
            made[target] = builder_for(tokenizer, folder)
        return made[target]

    return builder


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation(target: str, *, thinking: bool, parallel: bool = True, text_before_calls: str = "") -> list[dict]:
    """A user asks; calls (parallel, or the forecast call alone) and their results; an answer; a
    second question; the forecast call and its result; the last answer. Turns 2, 5, 7 and 9 are
    the assistant's (2, 4, 6 and 8 with one call first: one result)."""
    ids = CALL_IDS.get(target.split("-")[0], NINE_CHARACTER_IDS)
    first = [_call(ids[i], name, args) for i, (name, args) in enumerate(OSLO)] if parallel else [_call(ids[2], *BERGEN[0])]
    results = [("rain, 7C", first[0]), ("14:05", first[1] if parallel else None)]

    def thought(text: str) -> dict:
        return {"reasoning_content": text} if thinking else {}

    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": first, **thought(R1)},
        *[{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": out} for out, c in results if c],
        {"role": "assistant", "content": A2, **thought(R2)},
        {"role": "user", "content": "And Bergen, three days?"},
        {"role": "assistant", "content": text_before_calls, "tool_calls": [_call(ids[2], *BERGEN[0])], **thought(R3)},
        {"role": "tool", "tool_call_id": ids[2], "name": "get_forecast", "content": "sun, 12C"},
        {"role": "assistant", "content": A4, **thought(R4)},
    ]


def _assistant_turns(messages: list[dict]) -> list[int]:
    return [k for k, m in enumerate(messages) if m["role"] == "assistant"]


def _written(target: str, mode: str, messages: list[dict], trained: list[int]) -> list[str]:
    """What the target wrote for each trained turn, as this mode trains it (keep: with thinking)."""
    first_calls, second_calls = CALLS_WRITTEN[target]
    frame = WRITES[target][mode] if mode == "keep" else WRITES[target][mode].replace("{r}", "")
    spans = []
    for k in trained:
        turn = messages[k]
        if turn.get("tool_calls"):
            body = first_calls if len(turn["tool_calls"]) > 1 else second_calls
        else:
            body = ANSWER_WRITTEN[target].format(a=turn["content"])
        spans.append(frame.format(r=turn.get("reasoning_content", ""), c=body))
    return spans


def _spans(builder, samples) -> list[str]:
    return [span for sample in samples for span in trained_spans(builder.tokenizer, sample.ids, sample.mask)]


def _problems(builder, samples, mode: str) -> list[str]:
    from eagleops.pipeline.training.prepare.check import trained_problems

    return [p for sample in samples for p in trained_problems(builder.tokenizer, sample, mode, builder.stop_ids)]


def _thinks(target: str, mode: str) -> bool:
    """Whether the record of this target in this mode carries thinking (off asks for none)."""
    return target in THINKERS and mode != "off"


# ---- the zoo's new entries are the real files ----------------------------------------------------


@pytest.mark.parametrize("entry", sorted(VERBATIM))
def test_each_new_template_is_the_recorded_file_byte_for_byte(entry):
    template = (ZOO / entry / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(template).hexdigest() == VERBATIM[entry]
    source = (ZOO / entry / "SOURCE.md").read_text()
    assert VERBATIM[entry] in source
    for artifact in (ZOO / entry).iterdir():
        assert artifact.name == "SOURCE.md" or artifact.name.removesuffix(".xz") in source, f"{artifact.name} not in SOURCE.md"


def test_the_mistral_tokenizer_gives_mistral_commons_own_ids(builders):
    """mistral-common's own expectation for a released v11 tokenizer (its test case
    chat-sample-weather-full-released-p11i): the BPE ranks, the control tokens and [CALL_ID] 33,
    [ARGS] 32 of Mistral-Small-3.2's tool calls."""
    tokenizer = builders("mistral-small-3.2").tokenizer
    text = (
        "<s>[SYSTEM_PROMPT]Don't make assumptions about what values to plug into functions.[/SYSTEM_PROMPT]"
        "[INST]I'm in Paris, France.[/INST][TOOL_CALLS]get_current_weather[CALL_ID]123456789[ARGS]"
        '{"location": "Paris, France", "format": "celsius"}</s>[TOOL_RESULTS]123456789[TOOL_CONTENT]22[/TOOL_RESULTS]'
    )
    assert tokenizer.encode(text, add_special_tokens=False) == [
        *[1, 17, 11874, 2405, 3180, 31215, 2314, 2549, 4213, 1317, 27148, 2203, 7389, 1046, 18],
        *[3, 1073, 4525, 1294, 6993, 1044, 5498, 1046, 4, 9, 1689, 45971, 1095, 45629, 33],
        *[1049, 1050, 1051, 1052, 1053, 1054, 1055, 1056, 1057, 32, 19227, 17611, 2811, 1429, 42572, 1044, 5498],
        *[1897, 1429, 8092, 2811, 1429, 1099, 79092, 46005, 2, 7, 1049, 1050, 1051, 1052, 1053, 1054, 1055, 1056, 1057],
        *[19, 1050, 1050, 8],
    ]
    assert (len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id) == (131072, 1, 2)


# ---- every reply the target wrote, tool calls included, trained as written -----------------------


@pytest.mark.parametrize(("target", "mode"), PARALLEL_CASES)
def test_parallel_calls_and_their_results_train_what_the_target_wrote(builders, target, mode):
    b = builders(target)
    messages = _conversation(target, thinking=_thinks(target, mode))
    trained = _assistant_turns(messages)
    samples = b.build(messages, trained, mode, tools=TOOLS)
    assert sorted(_spans(b, samples)) == sorted(_written(target, mode, messages, trained))
    assert _problems(b, samples, mode) == []
    rendered = "".join(b.tokenizer.decode(s.ids) for s in samples)
    assert "rain, 7C" in rendered and "14:05" in rendered  # both results are in the prompt, untrained


@pytest.mark.parametrize(("target", "mode"), CASES)
def test_one_call_a_reply_trains_what_the_target_wrote(builders, target, mode):
    b = builders(target)
    messages = _conversation(target, thinking=_thinks(target, mode), parallel=False)
    trained = _assistant_turns(messages)
    samples = b.build(messages, trained, mode, tools=TOOLS)
    assert sorted(_spans(b, samples)) == sorted(_written(target, mode, messages, trained))
    assert _problems(b, samples, mode) == []


@pytest.mark.parametrize(("target", "mode"), PARALLEL_CASES)
def test_another_models_calls_in_the_history_are_never_trained(builders, target, mode):
    """A chat whose calls were made by the model the dataset came from: they stay in the prompt
    (rendered the target's way), only the target's answers are trained."""
    b = builders(target)
    messages = _conversation(target, thinking=False)
    for k in (5, 9):  # the target's answers, with its thinking
        messages[k] = {**messages[k], **({"reasoning_content": (R2, R4)[k == 9]} if _thinks(target, mode) else {})}
    samples = b.build(messages, [5, 9], mode, tools=TOOLS)
    assert sorted(_spans(b, samples)) == sorted(_written(target, mode, messages, [5, 9]))
    assert _problems(b, samples, mode) == []


@pytest.mark.parametrize("target", ["qwen3-8b", "qwen3-thinking-2507", "qwen3-coder-30b-a3b", "kimi-k2.5"])
def test_words_before_the_calls_are_trained_with_them(builders, target):
    """Qwen3 writes its words, a newline, then the calls; Qwen3-Coder its words trimmed, a blank
    line, then the calls; Kimi its words, then the call section."""
    b = builders(target)
    mode = "keep" if target in THINKERS else "off"
    messages = _conversation(target, thinking=target in THINKERS, text_before_calls="Checking Bergen.")
    samples = b.build(messages, [7], mode, tools=TOOLS)
    between = {"qwen3-coder-30b-a3b": "\n\n", "kimi-k2.5": ""}.get(target, "\n")
    calls = "Checking Bergen." + between + CALLS_WRITTEN[target][1]
    assert _spans(b, samples) == [WRITES[target][mode].format(r=R3, c=calls)]


# ---- the server's own ids: a call reply's thinking told apart under drop -------------------------


@pytest.mark.parametrize("target", ["qwen3-8b", "qwen3-thinking-2507", "kimi-k2.5", "kimi-k2-thinking"])
def test_with_the_servers_ids_drop_trains_the_calls_not_the_thinking(builders, target):
    b = builders(target)
    messages = _conversation(target, thinking=True)
    emitted = b.tokenizer.encode(WRITES[target]["keep"].format(r=R1, c=CALLS_WRITTEN[target][0]), add_special_tokens=False)
    samples = b.build(messages[:3], [2], "drop", exact=emitted, tools=TOOLS)
    assert samples[0].ids[-len(emitted) :] == emitted and samples[0].replies[0].exact
    assert _spans(b, samples) == [CALLS_WRITTEN[target][0]]
    kept = b.build(messages[:3], [2], "keep", exact=emitted, tools=TOOLS)
    assert _spans(b, kept) == [WRITES[target]["keep"].format(r=R1, c=CALLS_WRITTEN[target][0])]


HARMONY_CALL = (
    '<|start|>assistant<|channel|>commentary to=functions.get_forecast <|constrain|>json<|message|>{"city":"Bergen","days":3}<|call|>'
)


@pytest.mark.parametrize("mode", ["keep", "off"])
def test_gpt_oss_calls_are_trained_as_the_server_returned_them(builders, mode):
    """gpt-oss's calls, in the form it writes them (the server's ids), and its answers rebuilt
    in its own format: analysis then final under keep, the final channel alone at low effort."""
    b = builders("gpt-oss-20b")
    messages = _conversation("gpt-oss-20b", thinking=mode == "keep", parallel=False)
    first_call, first_answer, second_call, last_answer = _assistant_turns(messages)
    calls = {first_call: HARMONY_CALL, second_call: HARMONY_CALL}
    if mode == "keep":
        calls = {k: f"<|channel|>analysis<|message|>{r}<|end|>{call}" for (k, call), r in zip(calls.items(), (R1, R3))}
    else:  # no analysis: after the prompt's <|start|>assistant, straight to the channel
        calls = {k: call.removeprefix("<|start|>assistant") for k, call in calls.items()}
    exact = {k: b.tokenizer.encode(text, add_special_tokens=False) for k, text in calls.items()}
    answer = "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant" if mode == "keep" else ""
    answers = [(answer + ANSWER_WRITTEN["gpt-oss-20b"]).format(r=r, a=a) for r, a in ((R2, A2), (R4, A4))]
    samples = b.build(messages, [first_call, first_answer, second_call, last_answer], mode, exact_turns=exact, tools=TOOLS)
    assert sorted(_spans(b, samples)) == sorted([*calls.values(), *answers])
    assert _problems(b, samples, mode) == []


def test_gpt_oss_call_without_the_servers_ids_under_drop_is_refused(builders):
    """Its analysis before a call does not end in the final channel its answers' format closes
    with: the thinking cannot be told apart from a rebuilt call, and prepare says so."""
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    messages = _conversation("gpt-oss-20b", thinking=True, parallel=False)
    with pytest.raises(PrepareError, match="turn 2 calls tools .* generate from a server that returns token ids"):
        builders("gpt-oss-20b").build(messages, _assistant_turns(messages), "drop", tools=TOOLS)


def test_mistral_words_the_template_drops_are_trained_from_the_servers_ids(builders):
    """Mistral-Small-3.2 may write words before [TOOL_CALLS]; its template drops them from the
    history. Without the server's ids the reply cannot be rebuilt as written, which the check on
    the first samples reports (prepare stops there); with them it is trained as it came."""
    b = builders("mistral-small-3.2")
    messages = _conversation("mistral-small-3.2", thinking=False, text_before_calls="Checking Bergen.")
    rebuilt = b.build(messages, [7], "off", tools=TOOLS)
    assert _problems(b, rebuilt, "off") == ["reply 1: its answer is not trained as written"]
    written = "Checking Bergen." + CALLS_WRITTEN["mistral-small-3.2"][1]
    emitted = b.tokenizer.encode(written, add_special_tokens=False)
    served = b.build(messages[:8], [7], "off", exact=emitted, tools=TOOLS)
    assert _spans(b, served) == [written] and _problems(b, served, "off") == []


# ---- what cannot be rendered or asked for is refused, saying why ---------------------------------


@pytest.mark.parametrize("mode", ["keep", "drop", "off"])
@pytest.mark.parametrize("trained", [[2, 5, 7, 9], [5, 9]])
def test_deepseek_v31_cannot_render_the_calls_vllm_gives_it(builders, mode, trained):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    messages = _conversation("deepseek-v3.1", thinking=mode != "off")
    with pytest.raises(PrepareError, match=r"arguments parsed into objects\): can only concatenate str \(not \"dict\"\)"):
        builders("deepseek-v3.1").build(messages, trained, mode, tools=TOOLS)


@pytest.mark.parametrize("mode", ["drop", "off"])
def test_llama_refuses_parallel_calls_as_its_template_does(builders, mode):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    messages = _conversation("llama-3.1-8b-instruct", thinking=False)
    with pytest.raises(PrepareError, match="This model only supports single tool-calls at once"):
        builders("llama-3.1-8b-instruct").build(messages, _assistant_turns(messages), mode, tools=TOOLS)


def test_mistral_refuses_call_ids_it_could_not_have_written(builders):
    """Its template takes nine-character ids only, as vLLM's Mistral parser writes them; an
    OpenAI-style id in the history is refused by the template, here as in the engine."""
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    messages = _conversation("mistral-small-3.2", thinking=False)
    messages[2]["tool_calls"][0]["id"] = messages[3]["tool_call_id"] = "call_weather_0"
    with pytest.raises(PrepareError, match="Tool call IDs should be alphanumeric strings with length 9"):
        builders("mistral-small-3.2").build(messages, [5], "off", tools=TOOLS)


@pytest.mark.parametrize("target", ["qwen3-coder-30b-a3b", "mistral-small-3.2"])
def test_kept_thinking_on_a_target_that_shows_none_is_refused(builders, target):
    from eagleops.pipeline.training.prepare.chat_template import PrepareError

    messages = _conversation(target, thinking=True)
    with pytest.raises(PrepareError, match='turn 5: the chat template shows no thinking.*thinking = "drop"'):
        builders(target).build(messages, _assistant_turns(messages), "keep", tools=TOOLS)


def _run_with_thinking(folder, thinking: str):
    from eagleops.pipeline.config import parse_run

    (folder / "src.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    data = {
        "name": "tools",
        "output_dir": str(folder / "out"),
        "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
        "datasets": [{"name": "agent", "path": str(folder / "src.jsonl"), "format": "conversations", "token_budget": 1000}],
        "thinking": thinking,
        "target": {"model": str(folder)},
    }
    return parse_run(data, origin=str(folder / "run.toml"), base_dir=folder)


@pytest.mark.parametrize("target", ["qwen3-thinking-2507", "qwen3-coder-30b-a3b", "mistral-small-3.2", "qwen3-8b"])
def test_thinking_off_is_refused_only_where_the_prompt_forces_thinking(builders, tmp_path, target):
    """Qwen3-Thinking-2507 opens <think> in every generation prompt and reads no switch: off is
    refused, naming the modes that work; the others can answer without thinking."""
    from eagleops.pipeline.errors import ConfigError
    from eagleops.pipeline.training.modeling.thinking_switch import require_thinking_can_stop

    tokenizer = builders(target).tokenizer
    require_thinking_can_stop(_run_with_thinking(tmp_path, "keep"), tokenizer)
    require_thinking_can_stop(_run_with_thinking(tmp_path, "drop"), tokenizer)
    if target != "qwen3-thinking-2507":
        require_thinking_can_stop(_run_with_thinking(tmp_path, "off"), tokenizer)
        return
    with pytest.raises(ConfigError) as refused:
        require_thinking_can_stop(_run_with_thinking(tmp_path, "off"), tokenizer)
    message = str(refused.value)
    assert 'thinking = "off" (datasets agent)' in message and "opens <think> in every generation prompt" in message
    assert 'Use thinking = "keep"' in message and '"drop"' in message


# ---- defects found here, fixed: a call reply is never rebuilt as an answer, nor sliced mid-token ------


def test_gpt_oss_call_after_its_analysis_with_the_servers_ids_under_drop(builders):
    """gpt-oss (harmony) writes its analysis, then the call on the commentary channel, ending
    with <|call|> (OpenAI's harmony format guide). Under drop the analysis is context, with as
    much of its close as the call shares with an answer's (``<|end|><|start|>assistant<|channel|>``,
    untrained before an answer too); the call from its channel on is trained, never rebuilt."""
    b = builders("gpt-oss-20b")
    messages = [{"role": "user", "content": "Forecast for Bergen?"}, {"role": "assistant", "content": "", "reasoning_content": R3}]
    messages[1]["tool_calls"] = [_call("call_0", *BERGEN[0])]
    call = (
        '<|start|>assistant<|channel|>commentary to=functions.get_forecast <|constrain|>json<|message|>{"city":"Bergen","days":3}<|call|>'
    )
    emitted = b.tokenizer.encode(f"<|channel|>analysis<|message|>{R3}<|end|>{call}", add_special_tokens=False)
    samples = b.build(messages, [1], "drop", exact=emitted, tools=TOOLS)
    assert samples[0].ids[-len(emitted) :] == emitted
    assert _spans(b, samples) == [call.removeprefix("<|start|>assistant<|channel|>")]


def test_a_thinking_2507_call_with_no_thinking_text_is_trained(builders):
    """A reasoning parser returns no thinking when the model closed its block at once: the reply
    is still the rest of an empty block, then the call."""
    b = builders("qwen3-thinking-2507")
    messages = [
        {"role": "user", "content": "Forecast for Bergen?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_0", *BERGEN[0])]},
    ]
    samples = b.build(messages, [1], "drop", tools=TOOLS)
    assert _spans(b, samples) == ["\n</think>\n\n" + HERMES_BERGEN]


# ---- one new template through every stage -------------------------------------------------------

STAGE_SETTINGS = {
    "prepare": {"draft_vocab_size": 64, "eval_fraction": 0.2, "eval_max": 2},
    "extract": {"shard_samples": 8, "batch_tokens": 1024},
    "train": {"epochs": 1, "max_steps": 4, "lr": 3e-3, "batch_size": 4, "ttt_length": 2, "checkpoint_every": 50, "log_every": 2},
    "eval": {"prompts": 2, "max_new_tokens": 8, "draft_tokens": 2},
}
CITIES = ["Oslo", "Bergen", "Tromsø", "Lyon", "Kyoto", "Quito"]


def _thinking_2507_target(zoo_model, folder):
    """The tiny Qwen3 checkpoint with Qwen3-Thinking-2507's template as its own."""
    shutil.copytree(zoo_model("qwen3-8b"), folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = (ZOO / "qwen3-thinking-2507" / "chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False))
    return folder


def _records(thinking: str) -> list[dict]:
    """Records as generate writes them: a reply after another model's parallel calls and their
    results, and a reply that is itself parallel calls (the record ends there)."""
    from eagleops.pipeline.generate.client import Completion
    from eagleops.pipeline.generate.conversation import assistant_turn
    from eagleops.pipeline.generate.records import generated_record
    from eagleops.pipeline.sources import Prompt

    records = []
    for i, city in enumerate(CITIES):
        calls = [_call(f"call_{i}_{n}", name, json.dumps({"city": city})) for n, name in enumerate(("get_weather", "get_time"))]
        history = (
            {"role": "user", "content": f"Weather and time in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": calls},  # the source model's calls
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"rain, {i}C"},
            {"role": "tool", "tool_call_id": calls[1]["id"], "content": f"1{i}:05"},
        )
        answer = Completion(f"Rainy, {i}C in {city}.", "stop", 90, 12, "server", "e", 0.1, 1, reasoning=f"Both results for {city}.")
        prompt = Prompt(f"answer{i}", history, i, i + 1, i + 1, tuple(TOOLS))
        records.append(generated_record(prompt, "after", [*history, assistant_turn(answer)], answer, [4], model="m", thinking=thinking))
        ask = ({"role": "user", "content": f"Check {city} for me."},)
        own = [
            _call(f"c{i}w", "get_weather", json.dumps({"city": city})),
            _call(f"c{i}f", "get_forecast", json.dumps({"city": city, "days": i + 1})),
        ]
        called = Completion("", "tool_calls", 60, 30, "server", "e", 0.1, 1, reasoning=f"Call both for {city}.", tool_calls=tuple(own))
        prompt = Prompt(f"call{i}", ask, i, i + 1, i + 1, tuple(TOOLS))
        records.append(generated_record(prompt, "calls", [*ask, assistant_turn(called)], called, [1], model="m", thinking=thinking))
    return records


def _written_by_2507(record: dict, mode: str) -> str:
    """Qwen3-Thinking-2507's reply (its prompt opened <think>\\n), written from its template: the
    calls' arguments as JSON objects, whatever escapes the server's text had (Tromsø)."""
    reply = record["conversations"][record["target_turns"][0]]
    body = reply["content"]
    if record["dataset"] == "calls":
        i = int(record["id"].removeprefix("call"))
        body = (
            f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{CITIES[i]}"}}}}\n</tool_call>\n'
            f'<tool_call>\n{{"name": "get_forecast", "arguments": {{"city": "{CITIES[i]}", "days": {i + 1}}}}}\n</tool_call>'
        )
    thought = f"{reply['reasoning_content']}\n</think>\n\n" if mode == "keep" else ""
    return f"{thought}{body}<|im_end|>"


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_a_thinking_2507_target_with_tool_calls_goes_through_every_stage(tmp_path, zoo_model, mode):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from eagleops.pipeline.config import parse_run
    from tests.conftest import run_stage, write_jsonl

    target = _thinking_2507_target(zoo_model, tmp_path / "qwen3-thinking-2507-tiny")
    records = _records(mode)
    for name in ("after", "calls"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": [{"role": "user", "content": "?"}]}])
        (tmp_path / "out" / name).mkdir(parents=True, exist_ok=True)
        write_jsonl(tmp_path / "out" / name / "data.jsonl", [r for r in records if r["dataset"] == name])
    datasets = [{"name": n, "path": str(tmp_path / f"{n}.jsonl"), "format": "messages", "token_budget": 1000} for n in ("after", "calls")]
    data = {"name": "t", "output_dir": str(tmp_path / "out"), "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}]}
    config = parse_run(
        {**data, "datasets": datasets, "thinking": mode, "target": {"model": str(target)}, **STAGE_SETTINGS},
        origin=str(tmp_path / "run.toml"),
        base_dir=tmp_path,
    )

    run_stage(config, "prepare")
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    held = [json.loads(line) for line in (config.prepared_dir / "eval.jsonl").read_text().splitlines()]
    assert held and all(tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n<think>\n") for row in held)
    spans = []
    for shard in sorted(config.prepared_dir.glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        ids, mask, offsets = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist(), tensors["offsets"].tolist()
        spans += [span for a, b in zip(offsets, offsets[1:]) for span in trained_spans(tokenizer, ids[a:b], mask[a:b])]
    held_ids = {row["id"] for row in held}
    assert sorted(spans) == sorted(_written_by_2507(r, mode) for r in records if r["id"] not in held_ids)

    for stage in ("extract", "train", "export"):
        run_stage(config, stage)
    exported = json.loads((config.export_dir.with_name(config.export_dir.name + "-speculators") / "config.json").read_text())
    assert exported["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    result = run_stage(config, "eval")
    assert result.prompts == len(held) and result.greedy_mismatches == 0  # the drafter never changes what the target writes
