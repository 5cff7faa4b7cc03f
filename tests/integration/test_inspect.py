"""``eagleops inspect RUN.toml`` (issue 18): every record built as prepare builds it, the trained
spans of the first samples marked (ASCII markers or ANSI), a line per dataset with the counts,
refusals by reason and mask problems, and an exit code that says whether prepare would go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleops.cli import main
from eagleops.pipeline.config import load_run
from eagleops.pipeline.training.prepare import inspect as inspect_module
from eagleops.pipeline.training.prepare.inspect import inspect_run, render_text, visible
from tests.conftest import write_jsonl

THOUGHT = "Two and two.\nThat makes four."


def _record(i: int, mode: str, *, thought: str | None = THOUGHT, question: str = "What is 2+2?") -> dict:
    reply = {"role": "assistant", "content": f"It is {i}."}
    if thought and mode != "off":
        reply["reasoning_content"] = thought
    conversation = [{"role": "user", "content": f"{question} ({i})"}, reply]
    return {"id": f"r{i}", "conversations": conversation, "target_turns": [1], "thinking": mode, "finish_reason": "stop"}


def _run_file(folder: Path, model: Path, datasets: dict[str, list[dict]], *, remote_code: bool = False, max_length: int = 2048) -> Path:
    """A run file whose datasets were generated already: OUT/<name>/data.jsonl holds ``records``."""
    lines = ['name = "inspect"', 'output_dir = "out"', "[[endpoints]]", 'base_url = "http://127.0.0.1:9/v1"', 'model = "m"']
    for name, records in datasets.items():
        (folder / "out" / name).mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "out" / name / "data.jsonl", records)
        lines += ["[[datasets]]", f'name = "{name}"', 'path = "src.jsonl"', 'format = "conversations"', "token_budget = 1000"]
    lines += ["[target]", f'model = "{model}"', f"trust_remote_code = {str(remote_code).lower()}"]
    lines += ["[prepare]", f"max_length = {max_length}"]
    (folder / "run.toml").write_text("\n".join(lines) + "\n")
    return folder / "run.toml"


@pytest.fixture
def qwen3_run(tmp_path, zoo_files) -> Path:
    return _run_file(
        tmp_path,
        zoo_files("qwen3-8b"),
        {
            "K": [_record(i, "keep") for i in range(4)],
            "D": [_record(i, "drop", question="Why?") for i in range(3)],
            "O": [_record(i, "off", question="How?") for i in range(2)],
        },
    )


def _ids(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_plain_rendering_marks_exactly_the_targets_reply(qwen3_run):
    report = inspect_run(load_run(qwen3_run), samples_per_dataset=1)
    text = render_text(report, color=False)
    assert text.splitlines()[0].startswith("legend: [[trained answer]]  {{trained thinking}}")
    keep, drop, off = (ds.shown[0] for ds in report.datasets)
    rendered = render_text(report)
    # keep: the thinking block and the answer with its turn end, nothing of the prompt
    assert "<|im_start|>assistant\n{{<think>\nTwo and two.\nThat makes four.\n</think>\n\n}}[[It is 0.<|im_end|>]]" in rendered
    assert [s.text for s in keep.spans if s.kind != "context"] == [
        "<think>\nTwo and two.\nThat makes four.\n</think>\n\n",
        "It is 0.<|im_end|>",
    ]
    # drop: the thinking stays in the sequence, untrained; the answer alone is trained
    assert [s.text for s in drop.spans if s.kind != "context"] == ["It is 0.<|im_end|>"]
    assert "\n</think>\n\n[[It is 0.<|im_end|>]]" in rendered and "Two and two" in drop.spans[0].text
    # off: the answer after the template's empty thinking block (as the target emitted it)
    assert [s.text for s in off.spans if s.kind != "context"][-1].endswith("It is 0.<|im_end|>")
    assert "\x1b" not in text and all(s.problems == [] for s in (keep, drop, off))
    assert [line.split("  ")[0] for line in text.splitlines() if line.startswith(("K  ", "D  ", "O  "))] == ["K", "D", "O"]
    drop_format, keep_format, off_format = report.formats
    assert (keep_format.mode, keep_format.opens, keep_format.closes) == ("keep", "'<think>\\n'", "'\\n</think>\\n\\n'")
    assert keep_format.generation_prompt == repr("<|im_end|>\n<|im_start|>assistant\n") and drop_format.mode == "drop"
    assert off_format.generation_prompt == repr("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_counts_and_thinking_share_are_what_prepare_trains(qwen3_run):
    report = inspect_run(load_run(qwen3_run), samples_per_dataset=0)
    from eagleops.pipeline.training.prepare.chat_template import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(load_run(qwen3_run).target)
    thinking = _ids(tokenizer, f"<think>\n{THOUGHT}\n</think>\n\n")
    answer = _ids(tokenizer, "It is 0.") + 1  # and <|im_end|>
    keep, drop, off = report.datasets
    assert (keep.conversations, keep.samples, keep.replies, keep.refused, keep.problems) == (4, 4, 4, {}, {})
    assert keep.trained == 4 * (thinking + answer) and keep.thinking_trained == 4 * thinking
    assert keep.thinking_share == pytest.approx(thinking / (thinking + answer))
    assert drop.trained == 3 * answer and drop.thinking_trained == 0 and drop.modes == {"drop": 3}
    assert off.replies == 2 and off.thinking_trained == 0 and report.ok and all(ds.shown == [] for ds in report.datasets)
    assert f"K  records 4  samples 4  replies 4  trained {keep.trained} tok  thinking {100 * keep.thinking_share:.0f}%" in render_text(
        report
    )


def test_samples_cut_at_max_length_are_counted_as_prepare_cuts_them(tmp_path, zoo_files):
    run = _run_file(tmp_path, zoo_files("qwen3-8b"), {"K": [_record(i, "keep") for i in range(2)]}, max_length=20)
    [ds] = inspect_run(load_run(run)).datasets
    assert ds.truncated == 2 and ds.tokens == 40 and ds.trained < 40


def test_a_refused_record_is_counted_by_reason_and_the_command_fails(tmp_path, zoo_files, capsys):
    """Llama-3.1's template shows no thinking: kept thinking cannot be trained as written."""
    records = [_record(0, "keep", thought=None), _record(1, "keep"), _record(2, "keep")]
    run = _run_file(tmp_path, zoo_files("llama-3.1-8b-instruct"), {"L": records})
    [ds] = inspect_run(load_run(run)).datasets
    assert ds.conversations == 3 and ds.samples == 1 and ds.refused_records == 2
    [(reason, refused)] = ds.refused.items()
    assert reason == "the chat template shows no thinking" and refused.first == "L/r1" and 'thinking = "drop"' in refused.message
    assert main(["inspect", str(run), "--color", "never"]) == 2
    out = capsys.readouterr().out
    assert "L  records 3  samples 1  replies 1" in out and "refused 2" in out
    assert "  refused 2: the chat template shows no thinking (first: L/r1)" in out


def test_a_mask_that_fails_the_check_is_shown_and_fails_the_command(qwen3_run, monkeypatch, capsys):
    real = inspect_module.build_row

    def prompt_trained_too(builder, row):  # a broken mask: the whole sequence trained
        built = real(builder, row)
        for sample in built:
            sample.mask = [1] * len(sample.mask)
        return built

    monkeypatch.setattr(inspect_module, "build_row", prompt_trained_too)
    assert main(["inspect", str(qwen3_run), "--samples", "0", "--dataset", "D"]) == 2
    out = capsys.readouterr().out
    assert "--- D/r0  thinking=drop" in out and "!!! mask check: reply 1: its thinking is trained (thinking = drop)" in out
    assert "mask problem 3: its thinking is trained (thinking = drop) (first: D/r0)" in out
    assert "K  " not in out  # --dataset: that dataset alone


def test_json_output_parses_and_exit_is_zero_when_clean(qwen3_run, capsys):
    assert main(["inspect", str(qwen3_run), "--json", "--samples", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and [d["name"] for d in report["datasets"]] == ["K", "D", "O"]
    keep = report["datasets"][0]
    assert keep["replies"] == 4 and 0 < keep["thinking_share"] < 1 and keep["refused"] == {}
    assert [s["kind"] for s in keep["shown"][0]["spans"]] == ["context", "thinking", "answer"]


def test_ansi_only_when_asked_or_on_a_terminal_without_no_color(qwen3_run, capsys, monkeypatch):
    assert main(["inspect", str(qwen3_run), "--color", "always", "--dataset", "K"]) == 0
    coloured = capsys.readouterr().out
    assert "\x1b[1;32mIt is 0.<|im_end|>\x1b[0m" in coloured and "\x1b[33m<think>\x1b[0m" in coloured and "[[" not in coloured
    main(["inspect", str(qwen3_run), "--dataset", "K"])  # auto, and stdout is not a terminal
    assert "\x1b" not in capsys.readouterr().out
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setenv("NO_COLOR", "1")
    main(["inspect", str(qwen3_run), "--dataset", "K"])
    assert "\x1b" not in capsys.readouterr().out


def test_control_characters_in_the_data_never_reach_the_terminal(tmp_path, zoo_files):
    run = _run_file(tmp_path, zoo_files("qwen3-8b"), {"K": [_record(0, "keep", question="Clear \x1b[2J this\r\u202eevil\x07")]})
    text = render_text(inspect_run(load_run(run)), color=True)
    assert "Clear \\x1b[2J this\\r\\u202eevil\\x07" in text
    assert "\r" not in text and "\u202e" not in text and "\x07" not in text
    assert visible("a\tb\nc\x00") == "a\tb\nc\\x00"


def test_long_prompts_are_shortened_in_the_middle_unless_full(tmp_path, zoo_files, capsys):
    run = _run_file(tmp_path, zoo_files("qwen3-8b"), {"K": [_record(0, "keep", question="word " * 400)]})
    main(["inspect", str(run)])
    assert "characters of context] ..." in capsys.readouterr().out
    main(["inspect", str(run), "--full"])
    assert "characters of context" not in capsys.readouterr().out


def test_kimi_k25s_own_tokenizer_and_format(tmp_path, zoo_files):
    run = _run_file(tmp_path, zoo_files("kimi-k2.5"), {"K": [_record(0, "keep")]}, remote_code=True)
    report = inspect_run(load_run(run))
    [keep] = report.formats
    assert keep.closes == "'</think>'" and report.ok
    [sample] = report.datasets[0].shown
    trained = "".join(s.text for s in sample.spans if s.kind != "context")
    assert trained.startswith(THOUGHT) and "</think>It is 0." in trained


def test_errors_are_one_line_with_the_usage_exit_code(tmp_path, qwen3_run, capsys):
    assert main(["inspect", str(tmp_path / "nothing.toml")]) == 2
    assert capsys.readouterr().err.strip().endswith("nothing.toml: no such run file")
    no_target = tmp_path / "plain.toml"
    no_target.write_text(qwen3_run.read_text().split("[target]")[0])
    assert main(["inspect", str(no_target)]) == 2
    assert "inspect needs a [target] table" in capsys.readouterr().err
    assert main(["inspect", str(qwen3_run), "--dataset", "Z"]) == 2
    assert "no dataset Z (the run file has K, D, O)" in capsys.readouterr().err
    missing = tmp_path / "missing.toml"
    missing.write_text(qwen3_run.read_text().replace(str(Path(load_run(qwen3_run).target.model)), str(tmp_path / "gone")))
    assert main(["inspect", str(missing)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"eagleops: {tmp_path / 'gone'}: no such checkpoint folder (the target's tokenizer is read from it)"
    )


def test_a_dataset_not_generated_yet_has_a_line_saying_so(tmp_path, zoo_files):
    run = _run_file(tmp_path, zoo_files("qwen3-8b"), {"K": [_record(0, "keep")], "N": []})
    (tmp_path / "out" / "N" / "data.jsonl").unlink()
    report = inspect_run(load_run(run))
    text = render_text(report)
    assert "N  not generated (no data.jsonl)" in text and "warning: prepare: " in text and report.ok


def test_a_sample_whose_prompt_fills_max_length_is_left_out_and_said_so(tmp_path, zoo_model):
    """Records from before generate checked lengths (or from another tool): prepare leaves out
    a sample that trains nothing and logs how many and why; inspect counts them and its sample
    header says "left out", not "trained"."""
    from eagleops.pipeline.training.context import StageContext
    from eagleops.pipeline.training.prepare.stage import prepare

    long_question = "Tell me about " + "the sea and the sky " * 60
    records = [_record(i, "keep") for i in range(3)] + [_record(9, "keep", question=long_question)]
    run = _run_file(tmp_path, zoo_model("qwen3-8b"), {"K": records}, max_length=160)
    report = inspect_run(load_run(run), samples_per_dataset=4)
    (ds,) = report.datasets
    assert ds.left_out == {"prompt_fills_max_length": 1}
    text = render_text(report)
    assert "left out: whose prompt fills max_length (160)" in text
    assert "left out 1" in text and "  left out 1: whose prompt fills max_length (160)" in text
    config = load_run(run)
    config = type(config)(**{**config.__dict__, "prepare": type(config.prepare)(**{**config.prepare.__dict__, "eval_fraction": 0.0})})
    ctx = StageContext("prepare")
    index = prepare(config, ctx)
    assert index.samples == 3 and index.dropped == {"prompt_fills_max_length": 1}
    assert any("left out 1 samples that train nothing: 1 whose prompt fills max_length (160)" in text for _, text in ctx.logs)
