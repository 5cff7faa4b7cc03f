"""``eagleops inspect RUN.toml``: what prepare would train, checked before any GPU time is spent.

Every generated record of every dataset is turned into its samples exactly as prepare turns it
(the target's own tokenizer and template, ``build_row``) and each sample's loss mask is checked
(``trained_problems``); only counts are kept, and the first few samples of each dataset (plus the
first one whose mask fails the check) as decoded text with the trained spans marked. A record
prepare would refuse is counted under a short reason with the first record that gave it. No model
is loaded: this is tokenization alone.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import EagleOpsError, UsageError
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.modeling.reply_format import PROBE_QUESTION, ReplyFormat
from eagleops.pipeline.training.modeling.target import require_target
from eagleops.pipeline.training.prepare.chat_template import PrepareError, load_chat_tokenizer
from eagleops.pipeline.training.prepare.check import trained_problems
from eagleops.pipeline.training.prepare.inputs import read_conversations
from eagleops.pipeline.training.prepare.samples import Built
from eagleops.pipeline.training.prepare.stage import DROPPED_AS, build_row, drop_reason, sample_builder

__all__ = ["DatasetReport", "FormatView", "InspectReport", "Reason", "SampleView", "Span", "inspect_run", "render_text"]

CONTEXT, THINKING, ANSWER = "context", "thinking", "answer"  # a span: not trained, trained thinking, trained answer


@dataclass
class Span:
    kind: str  # CONTEXT, THINKING or ANSWER
    text: str


@dataclass
class SampleView:
    """One sample as decoded text, its spans in order."""

    dataset: str
    id: str
    thinking: str  # the record's thinking mode
    tokens: int
    trained: int  # ids with loss within max_length
    spans: list[Span]
    problems: list[str]
    left_out: str = ""  # why prepare leaves it out (it trains nothing), in words


@dataclass
class Reason:
    count: int
    first: str  # DATASET/ID of the first record (or sample) that gave it
    message: str  # that record's full message


@dataclass
class FormatView:
    """The reply format learned from the template for one thinking mode (opens/closes as repr)."""

    mode: str
    learned_from: str
    generation_prompt: str  # its end, after the user's turn
    opens: str
    closes: str
    bare: str


@dataclass
class DatasetReport:
    name: str
    generated: bool = True  # its data.jsonl exists
    conversations: int = 0  # records read (after deduplication by prompt)
    samples: int = 0
    replies: int = 0  # replies trained
    tokens: int = 0  # ids of the samples, each cut at max_length as prepare cuts it
    trained: int = 0  # ids with loss
    thinking_trained: int = 0  # of those, thinking
    truncated: int = 0  # samples longer than max_length
    left_out: dict[str, int] = field(default_factory=dict)  # samples prepare leaves out (nothing trained), by reason
    skipped: int = 0  # rows generate did not send: too long to train a reply after
    exact: int = 0  # replies trained on the server's own ids
    modes: dict[str, int] = field(default_factory=dict)  # records per thinking mode
    refused: dict[str, Reason] = field(default_factory=dict)  # records prepare refuses, by reason
    problems: dict[str, Reason] = field(default_factory=dict)  # samples whose mask fails the check, by reason
    shown: list[SampleView] = field(default_factory=list)

    @property
    def thinking_share(self) -> float:
        return self.thinking_trained / self.trained if self.trained else 0.0

    @property
    def refused_records(self) -> int:
        return sum(r.count for r in self.refused.values())

    @property
    def problem_samples(self) -> int:
        return sum(r.count for r in self.problems.values())


@dataclass
class InspectReport:
    run: str
    tokenizer: str
    max_length: int
    duplicates: int  # records dropped as a repeated prompt
    formats: list[FormatView]
    datasets: list[DatasetReport]
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(d.refused or d.problems for d in self.datasets)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for out, ds in zip(data["datasets"], self.datasets, strict=True):
            out["thinking_share"] = round(ds.thinking_share, 6)
            out["refused_records"] = ds.refused_records
            out["problem_samples"] = ds.problem_samples
        return data


# ---- building the report ----------------------------------------------------------------------------


def _reason(message: str, row: dict[str, Any]) -> str:
    """A refusal's short reason: the message without the record's name, the turn, or the advice."""
    text = message.removeprefix(f"{row['dataset']}/{row['id']}: ")
    text = re.sub(r"^turn \d+: ", "", text)
    return text.split(", so ", 1)[0].split("; ", 1)[0].strip()


def _problem(text: str) -> str:
    return re.sub(r"^\d+ trained ids", "trained ids", re.sub(r"^reply \d+: ", "", text))


def _count(reasons: dict[str, Reason], reason: str, where: str, message: str) -> None:
    if reason in reasons:
        reasons[reason].count += 1
    else:
        reasons[reason] = Reason(1, where, message)


def _kinds(built: Built) -> list[str]:
    """Per id of the sample: CONTEXT (no loss), THINKING or ANSWER (with loss)."""
    kinds = [ANSWER if m else CONTEXT for m in built.mask]
    for reply in built.replies:
        for i in range(reply.start, reply.start + reply.thinking):
            if kinds[i] == ANSWER:
                kinds[i] = THINKING
    return kinds


def _view(tokenizer: Any, built: Built, row: dict[str, Any], problems: list[str], max_length: int) -> SampleView:
    kinds = _kinds(built)
    spans: list[Span] = []
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            spans.append(Span(kinds[start], tokenizer.decode(built.ids[start:i])))
            start = i
    reason = drop_reason(built, max_length)
    left_out = f"{DROPPED_AS[reason]} ({max_length:,})" if reason else ""
    return SampleView(row["dataset"], row["id"], row["thinking"], built.length, sum(built.mask[:max_length]), spans, problems, left_out)


def _add_sample(
    ds: DatasetReport, built: Built, row: dict[str, Any], max_length: int, stop_ids: Collection[int], tokenizer: Any, shown: int
) -> None:
    ds.samples += 1
    ds.truncated += built.length > max_length
    ds.tokens += min(built.length, max_length)
    ds.trained += sum(built.mask[:max_length])
    if (reason := drop_reason(built, max_length)) is not None:
        ds.left_out[reason] = ds.left_out.get(reason, 0) + 1
    for reply in built.replies:
        ds.replies += 1
        ds.exact += reply.exact
        ds.thinking_trained += sum(built.mask[reply.start : min(reply.start + reply.thinking, max_length)])
    problems = trained_problems(tokenizer, built, row["thinking"], stop_ids, row["finished"])
    first_problem = bool(problems) and not ds.problems
    for text in problems:
        _count(ds.problems, _problem(text), f"{row['dataset']}/{row['id']}", text)
    if len(ds.shown) < shown or (first_problem and not any(s.problems for s in ds.shown)):
        ds.shown.append(_view(tokenizer, built, row, problems, max_length))


def _format_view(mode: str, fmt: ReplyFormat) -> FormatView:
    prompt = fmt.generation_prompt.rpartition(PROBE_QUESTION)[2]  # after the question of the probe it was learned from
    return FormatView(mode, fmt.learned_from, repr(prompt), repr(fmt.opens), repr(fmt.closes), repr(fmt.bare))


def _tokenizer(config: RunConfig) -> Any:
    """The target's own tokenizer; one that does not load is one line naming its folder."""
    target = require_target(config)
    if not target.tokenizer_path.is_dir():
        raise PrepareError(f"{target.tokenizer_path}: no such checkpoint folder (the target's tokenizer is read from it)")
    try:
        return load_chat_tokenizer(target)
    except EagleOpsError:
        raise
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrepareError(f"{target.tokenizer_path}: the target's tokenizer does not load: {first}") from None


def _skipped(config: RunConfig, dataset: str) -> int:
    """Rows generate skipped as too long to train (its manifest's count)."""
    try:
        return int(json.loads(config.layout.dataset(dataset).manifest.read_text())["totals"].get("skipped", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _template_error() -> type[Exception]:
    try:
        from jinja2.exceptions import TemplateError

        return TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        return PrepareError


def inspect_run(config: RunConfig, samples_per_dataset: int = 2, datasets: Collection[str] | None = None) -> InspectReport:
    """Every record of the run's datasets (or of ``datasets``) built as prepare builds it; the
    counts, refusals and mask problems per dataset, and the first ``samples_per_dataset`` samples."""
    target = require_target(config)
    names = [ds.name for ds in config.datasets]
    unknown = sorted(set(datasets or ()) - set(names))
    if unknown:
        raise UsageError(f"{config.source}: no dataset {', '.join(unknown)} (the run file has {', '.join(names)})")
    wanted = [n for n in names if datasets is None or n in datasets]
    tokenizer = _tokenizer(config)
    ctx = StageContext("inspect")
    rows, duplicates = read_conversations(config, ctx)
    builder = sample_builder(config, tokenizer)
    reports = {n: DatasetReport(n, generated=config.layout.dataset(n).data.exists(), skipped=_skipped(config, n)) for n in wanted}
    refusal = (PrepareError, _template_error())
    max_length = config.prepare.max_length
    for row in rows:
        ds = reports.get(row["dataset"])
        if ds is None:
            continue
        ds.conversations += 1
        ds.modes[row["thinking"]] = ds.modes.get(row["thinking"], 0) + 1
        try:
            built = build_row(builder, row)
        except refusal as exc:
            _count(ds.refused, _reason(str(exc), row), f"{row['dataset']}/{row['id']}", str(exc))
            continue
        for sample in built:
            _add_sample(ds, sample, row, max_length, builder.stop_ids, tokenizer, samples_per_dataset)
    used = sorted({mode for ds in reports.values() for mode in ds.modes})
    return InspectReport(
        run=str(config.source),
        tokenizer=str(target.tokenizer_path),
        max_length=max_length,
        duplicates=duplicates,
        formats=[_format_view(mode, builder.formats[mode]) for mode in used],
        datasets=list(reports.values()),
        warnings=[text for level, text in ctx.logs if level != "info"],
    )


# ---- rendering ----------------------------------------------------------------------------------

LEGEND = "legend: [[trained answer]]  {{trained thinking}}  the rest is context, not trained"
ANSI_LEGEND = "legend: \x1b[1;32mtrained answer\x1b[0m  \x1b[33mtrained thinking\x1b[0m  \x1b[2mcontext, not trained\x1b[0m"
_MARKS = {ANSWER: ("[[", "]]"), THINKING: ("{{", "}}"), CONTEXT: ("", "")}
_STYLES = {ANSWER: "\x1b[1;32m", THINKING: "\x1b[33m", CONTEXT: "\x1b[2m"}
_RESET = "\x1b[0m"
_BIDI = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A))  # would reorder the terminal's text


def visible(text: str) -> str:
    """``text`` safe for a terminal: newlines and tabs kept, every other control character (and
    bidirectional override) written as an escape, ``\\x1b`` or ``\\u202e``."""
    out = []
    for ch in text:
        if ch in "\n\t":
            out.append(ch)
        elif unicodedata.category(ch) == "Cc" or ord(ch) in _BIDI:
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def _elide(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    head, tail = limit // 3, limit - limit // 3
    return f"{text[:head]} ... [{len(text) - head - tail:,} characters of context] ... {text[-tail:]}"


def _render_span(span: Span, color: bool, context_chars: int | None) -> str:
    text = visible(span.text if span.kind != CONTEXT else _elide(span.text, context_chars))
    if not color:
        opens, closes = _MARKS[span.kind]
        return opens + text + closes
    style = _STYLES[span.kind]  # per line, so a pager showing one line keeps the colour
    return "\n".join(style + line + _RESET if line else line for line in text.split("\n"))


def render_sample(sample: SampleView, color: bool = False, context_chars: int | None = None) -> str:
    trained = f"left out: {sample.left_out}" if sample.left_out else f"{sample.trained:,} trained"
    head = f"--- {sample.dataset}/{visible(sample.id)}  thinking={sample.thinking}  {sample.tokens:,} tokens, {trained} ---"
    body = "".join(_render_span(span, color, context_chars) for span in sample.spans)
    lines = [head, body]
    lines += [f"!!! mask check: {problem}" for problem in sample.problems]
    return "\n".join(lines)


def summary_line(ds: DatasetReport) -> str:
    if not ds.generated:
        return f"{ds.name}  not generated (no data.jsonl)"
    line = (
        f"{ds.name}  records {ds.conversations:,}  samples {ds.samples:,}  replies {ds.replies:,}  "
        f"trained {ds.trained:,} tok  thinking {100 * ds.thinking_share:.0f}%  cut {ds.truncated:,}  "
        f"left out {sum(ds.left_out.values()):,}  refused {ds.refused_records:,}  mask problems {ds.problem_samples:,}"
    )
    return line + (f"  (generate skipped {ds.skipped:,} rows too long to train)" if ds.skipped else "")


def _reason_lines(label: str, reasons: dict[str, Reason]) -> list[str]:
    return [f"  {label} {r.count:,}: {visible(reason)} (first: {visible(r.first)})" for reason, r in reasons.items()]


def render_text(report: InspectReport, color: bool = False, context_chars: int | None = 600) -> str:
    """The report for a person: a legend, the learned reply formats, the samples with their
    trained spans marked (ANSI colour or ASCII markers), and a line per dataset. Untrained
    stretches longer than ``context_chars`` are shortened in the middle (None: never)."""
    lines = [ANSI_LEGEND if color else LEGEND, f"target tokenizer: {report.tokenizer}  max_length {report.max_length:,}"]
    for fmt in report.formats:
        lines.append(f"reply format, thinking={fmt.mode}: {fmt.learned_from}")
        lines.append(
            f"  prompt ends {visible(fmt.generation_prompt)}  opens {visible(fmt.opens)}  closes {visible(fmt.closes)}  bare {visible(fmt.bare)}"
        )
    lines += [f"warning: {visible(w)}" for w in report.warnings]
    for ds in report.datasets:
        lines += ["", *(render_sample(s, color, context_chars) for s in ds.shown)]
    lines.append("")
    for ds in report.datasets:
        lines.append(summary_line(ds))
        lines += [f"  left out {n:,}: {DROPPED_AS[why]} ({report.max_length:,})" for why, n in ds.left_out.items()]
        lines += _reason_lines("refused", ds.refused) + _reason_lines("mask problem", ds.problems)
    if report.duplicates:
        lines.append(f"({report.duplicates:,} records with a repeated prompt left out, as prepare does)")
    return "\n".join(lines)
