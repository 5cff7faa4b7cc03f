"""``eagleops``: the command line, one argument tree for every command (a stage's subcommand
and torchrun's entry come from ``pipeline.stages``). Textual is imported only when a TUI is really
opened; the entry point (``eagleops.__main__``) has set the signals by the time this is imported."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from eagleops.console.report import detail_text, format_event, json_line, status_line
from eagleops.pipeline.config import load_run, parse_tokens
from eagleops.pipeline.errors import EagleOpsError, ExitCode
from eagleops.pipeline.protocol.control import ControlClient, ControlError, find_sockets, runtime_dir
from eagleops.pipeline.protocol.events import Command, DatasetProgress, Kill, Pause, Resume, SetBudget
from eagleops.pipeline.stages import STAGE_NAMES, STAGES, stage
from eagleops.ranks import run_on_every_rank, under_torchrun
from eagleops.signals import hung_up

DEMO_DIR = Path("eagleops-demo")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagleops", description="Train EAGLE-3 drafters: generate, watch, steer.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_theme(p: argparse.ArgumentParser) -> None:
        p.add_argument("--theme", choices=("dark", "light"), default="dark", help="console colours (themes/*.tcss)")
        p.add_argument("--refresh", type=float, default=1.0, help="console repaint interval in seconds (default 1)")

    def add_view_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-tui", action="store_true", help="headless: print status lines (for nohup/CI)")
        p.add_argument("--json", action="store_true", help="headless, one JSON event per line")
        p.add_argument("--in-process", action="store_true", help="the engine inside the console: it stops when the console does")
        add_theme(p)

    run = sub.add_parser("run", help="run the pipeline described by a run file")
    run.add_argument("run_file", type=Path)
    add_view_flags(run)

    for each in STAGES:  # one stage alone; `run` runs those the run file names
        p = sub.add_parser(each.name, help=each.summary)
        p.add_argument("run_file", type=Path)
        add_view_flags(p)

    inspect = sub.add_parser("inspect", help="show what prepare would train: samples with trained spans marked, counts, refusals")
    inspect.add_argument("run_file", type=Path)
    inspect.add_argument("--samples", type=int, default=2, metavar="N", help="samples shown per dataset (default 2)")
    inspect.add_argument("--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)")
    inspect.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="ANSI colour (auto: a terminal, NO_COLOR unset)"
    )
    inspect.add_argument("--full", action="store_true", help="show long prompts whole (default: shortened in the middle)")
    inspect.add_argument("--json", action="store_true", help="the report as one JSON object, nothing rendered")

    sources = sub.add_parser("sources", help="each dataset's shards and first rows as generate reads them (field maps checked)")
    sources.add_argument("run_file", type=Path)
    sources.add_argument("--rows", type=int, default=3, metavar="N", help="rows shown per dataset (default 3)")
    sources.add_argument("--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)")
    sources.add_argument("--json", action="store_true", help="one JSON list, nothing rendered")

    add_view_flags(_demo_parser(sub))

    def add_socket(p: argparse.ArgumentParser) -> None:
        p.add_argument("--socket", type=Path, help="control socket of the run (default: the one running)")

    attach = sub.add_parser("attach", help="open the console on a run started with --no-tui")
    attach.add_argument("socket", nargs="?", type=Path, help="its control socket (default: the one running)")
    # the same --socket every other command takes, which the several-engines error names
    attach.add_argument("--socket", dest="socket_option", type=Path, help=argparse.SUPPRESS)
    add_theme(attach)

    status = sub.add_parser("status", help="show a running engine's datasets")
    status.add_argument("--json", action="store_true")
    add_socket(status)
    detail = sub.add_parser("detail", help="one dataset in detail: failures by reason, latency, endpoints")
    detail.add_argument("dataset")
    detail.add_argument("--json", action="store_true")
    add_socket(detail)
    for name, what in (
        ("pause", "stop issuing requests (in-flight finish)"),
        ("resume", "resume issuing"),
        ("kill", "cancel in-flight requests and stop"),
    ):
        p = sub.add_parser(name, help=f"{what}: the run, one dataset, or one stage (--stage)")
        p.add_argument("dataset", nargs="?", help="this dataset only")
        p.add_argument("--stage", choices=STAGE_NAMES, help="this stage only (generate: every dataset)")
        add_socket(p)
    budget = sub.add_parser("budget", help="change a dataset's token budget live (10M, 500k, 12000)")
    budget.add_argument("dataset")
    budget.add_argument("tokens")
    add_socket(budget)
    return parser


def _demo_parser(sub: Any) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="offline end-to-end run on a tiny local model (--real: on SmolLM2 and ShareGPT)")
    demo.add_argument("--dir", type=Path, default=DEMO_DIR, help="where the demo keeps its files (--real: eagleops-demo-real)")
    demo.add_argument("--fresh", action="store_true", help="discard the demo's earlier output and generate again")
    demo.add_argument(
        "--real", action="store_true", help="the real SmolLM2-135M-Instruct on the raw ShareGPT file (17.5 minutes on 2 busy cores)"
    )
    return demo


def _die(message: str, code: int = ExitCode.FAILED) -> int:
    print(f"eagleops: {message}", file=sys.stderr)
    return code


def _socket(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    if env := os.environ.get("EAGLEOPS_SOCKET"):
        return Path(env)
    live = find_sockets()
    if not live:
        raise ControlError(f"no running eagleops engine found in {runtime_dir()} (start one with `eagleops run RUN.toml --no-tui`)")
    if len(live) > 1:
        names = "\n  ".join(str(p) for p in live)
        raise ControlError(f"several engines are running; choose one with --socket SOCKET:\n  {names}")
    return live[0]


async def _remote(args: argparse.Namespace) -> int:
    client = ControlClient(_socket(args.socket))
    try:
        if args.command == "status":
            events = await client.status()
            if args.json:
                for event in events:
                    print(json_line(event))
                return 0
            for event in events:
                if isinstance(event, DatasetProgress):
                    print(status_line(event))
                elif event.kind in ("run", "stage", "endpoint") and (line := format_event(event)):
                    print(line)
            return 0
        if args.command == "detail":
            detail = await client.detail(args.dataset)
            print(json.dumps(detail, indent=1) if args.json else detail_text(detail))
            return 0
        if args.command == "budget":
            try:
                tokens = parse_tokens(args.tokens)
            except ValueError as exc:
                return _die(str(exc), ExitCode.USAGE)
            command: Command = SetBudget(args.dataset, tokens)
        else:
            if args.dataset is not None and args.stage is not None:
                return _die(f"{args.command}: a dataset or --stage, not both", ExitCode.USAGE)
            command = {"pause": Pause, "resume": Resume, "kill": Kill}[args.command](args.dataset, stage=args.stage)
        ack = await client.send(command)
        print(ack.message)
        return 0 if ack.ok else 1
    finally:
        await client.close()


def _run(config, args: argparse.Namespace, stages: tuple[str, ...] | None = None) -> int:
    from eagleops.headless import run_headless

    if stages is not None and under_torchrun():  # torchrun's `-m eagleops train`: this rank's share
        return run_on_every_rank(config, stages[0])
    if not (args.no_tui or args.json):
        if not sys.stdout.isatty():
            print("eagleops: stdout is not a terminal; running headless (--no-tui)", file=sys.stderr)
        elif getattr(args, "in_process", False) or args.command == "demo":  # the demo's model server lives in this process
            from eagleops.console.session import run_console

            return asyncio.run(run_console(config, theme=args.theme, refresh_s=args.refresh, stages=stages))
        else:
            return _run_detached(config, args)
    return asyncio.run(run_headless(config, as_json=args.json, stages=stages, hung_up=hung_up))


def _run_detached(config, args: argparse.Namespace) -> int:
    """The engine in a session of its own, the console attached: closing it leaves the run going."""
    from eagleops.console.detached import start_detached
    from eagleops.console.session import attach_console

    engine = start_detached(config, [args.command, str(args.run_file)])
    if (code := engine.exit_code()) is not None:
        print(engine.tail())
        return code
    asyncio.run(attach_console(engine.socket, theme=args.theme, refresh_s=args.refresh))
    time.sleep(0.2)  # an engine that has just finished is reaped, not reported as still running
    if (code := engine.exit_code()) is not None:
        return code
    if engine.proc is None or engine.proc.poll() is None:
        pid = f" (pid {engine.proc.pid})" if engine.proc is not None else ""
        print(f"eagleops: the run goes on{pid}; `eagleops attach` to watch it, `eagleops kill` to stop it; log: {engine.log}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """Exit 0 when every record builds and every mask checks out; 2 (what prepare would exit) if not."""
    from eagleops.pipeline.training.prepare.inspect import inspect_run, render_text

    if args.samples < 0:
        return _die("--samples must be 0 or more", ExitCode.USAGE)
    config = load_run(args.run_file)
    if config.target is None:
        return _die(f"{args.run_file}: inspect needs a [target] table naming the target model", ExitCode.USAGE)
    report = inspect_run(config, args.samples, args.dataset)
    if args.json:
        print(json.dumps(report.to_json(), ensure_ascii=False, indent=1))
    else:
        color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
        print(render_text(report, color=color, context_chars=None if args.full else 600))
    return 0 if report.ok else ExitCode.USAGE


def _sources(args: argparse.Namespace) -> int:
    """Exit 0 when every source opens and its first rows read; 2 when one does not."""
    from eagleops.pipeline.sources.preview import preview_json, preview_sources, render_preview

    previews = preview_sources(load_run(args.run_file), max(1, args.rows), args.dataset)
    width = shutil.get_terminal_size((80, 24)).columns
    print(preview_json(previews) if args.json else render_preview(previews, max(60, width)), end="" if not args.json else "\n")
    return ExitCode.USAGE if any(p.error or (p.bad and not p.rows) for p in previews) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(load_run(args.run_file), args)
        if args.command in STAGE_NAMES:
            config = load_run(args.run_file)
            if config.target is None and stage(args.command).needs_target:
                return _die(f"{args.run_file}: {args.command} needs a [target] table naming the target model", ExitCode.USAGE)
            return _run(config, args, stages=(args.command,))
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "sources":
            return _sources(args)
        if args.command == "demo":
            from eagleops.pipeline.demo.demo import DemoRun, prepare_demo, prepare_real_demo

            say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
            demo: DemoRun
            if args.real:
                directory = args.dir if args.dir != DEMO_DIR else Path("eagleops-demo-real")
                demo = prepare_real_demo(directory, fresh=args.fresh, log=say)
            else:
                demo = prepare_demo(args.dir, fresh=args.fresh, log=say)
            with demo.serve() as run_path:
                return _run(load_run(run_path), args)
        if args.command == "attach":
            from eagleops.console.session import attach_console

            return asyncio.run(attach_console(_socket(args.socket or args.socket_option), theme=args.theme, refresh_s=args.refresh))
        return asyncio.run(_remote(args))
    except EagleOpsError as exc:
        return _die(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return ExitCode.KILLED
    except BrokenPipeError:  # `eagleops status --json | head -1`: the reader had what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's exit flush does not fail again
        return 0
