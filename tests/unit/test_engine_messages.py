"""Tool calls are rendered as the serving engine renders them: vLLM and SGLang parse an assistant
turn's ``arguments`` into an object before the template sees it. Our copy of that rule
(``as_engine_renders``) is checked against vLLM's own function, in vLLM's venv, on the awkward
cases; and a template that needs text fails in the engine exactly as it fails in prepare."""

from __future__ import annotations

import json
import subprocess

import pytest

from eagleops.pipeline.formats.engine_messages import as_engine_renders
from tests.vllm_support import PYTHON, VLLM_MARKS

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def _assistant(arguments, **extra) -> dict:
    return {
        "role": "assistant",
        "content": extra.pop("content", ""),
        "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": arguments}}],
        **extra,
    }


CASES = {
    "json text": [_assistant('{"city": "Oslo", "days": [1, 2]}')],
    "an object already": [_assistant({"city": "Oslo"})],
    "not JSON": [_assistant("{city: Oslo")],
    "JSON but not an object": [_assistant("[1, 2]"), _assistant("42"), _assistant("null")],
    "empty": [_assistant(""), _assistant(None)],
    "content None": [_assistant("{}", content=None)],
    "parallel calls": [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**CALL, "id": "a"},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
            ],
        }
    ],
    "no calls": [{"role": "assistant", "content": "hi", "tool_calls": []}],
}


def test_arguments_become_objects_as_vllm_makes_them():
    out = as_engine_renders(CASES["json text"] + CASES["not JSON"] + CASES["empty"] + CASES["no calls"] + CASES["content None"])
    assert [m["tool_calls"][0]["function"]["arguments"] for m in out[:4]] == [{"city": "Oslo", "days": [1, 2]}, {}, {}, {}]
    assert "tool_calls" not in out[4] and out[5]["content"] == ""
    assert CASES["json text"][0]["tool_calls"][0]["function"]["arguments"].startswith("{")  # the input is left as it was


@pytest.fixture(scope="module")
def vllms_own(zoo_files) -> dict:
    """vLLM 0.32's ``_postprocess_messages`` (what its server runs before every template) over
    every case, and the DeepSeek-V3.1 template rendered from what it gives: one import of vLLM."""
    folder = zoo_files("deepseek-v3.1")
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from vllm.renderers.chat_utils import _postprocess_messages\n"
        "cases, deepseek = json.load(sys.stdin)\n"
        "for messages in cases.values():\n"
        "    for m in messages:\n"
        "        m['content'] = m['content'] if m.get('content') is not None else ''\n"  # its parser does this first
        "    _postprocess_messages(messages)\n"
        "_postprocess_messages(deepseek)\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})\n"
        "try:\n"
        "    tokenizer.apply_chat_template(deepseek, add_generation_prompt=True, tokenize=False)\n"
        "    failure = None\n"
        "except Exception as exc:\n"
        "    failure = f'{type(exc).__name__} {exc}'\n"
        "print(json.dumps({'cases': cases, 'deepseek': failure}))\n"
    )
    deepseek = [{"role": "user", "content": "Weather?"}, *CASES["json text"], {"role": "tool", "content": "rain", "tool_call_id": "c1"}]
    done = subprocess.run([PYTHON, "-c", script], input=json.dumps([CASES, deepseek]), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("_", [pytest.param(None, marks=VLLM_MARKS)])
def test_our_rule_is_vllms_own(vllms_own, case, _):
    assert vllms_own["cases"][case] == as_engine_renders(CASES[case])


@pytest.mark.parametrize("_", [pytest.param(None, marks=VLLM_MARKS)])
def test_a_template_that_concatenates_arguments_fails_in_the_engine_too(vllms_own, _):
    """DeepSeek-V3.1's real template adds ``arguments`` to a string: with the object vLLM gives
    it, vLLM's own rendering raises; prepare refuses such a record for the same reason, rather
    than train on a rendering the target never saw (tests/unit/test_target_formats.py)."""
    assert vllms_own["deepseek"] == 'TypeError can only concatenate str (not "dict") to str'
