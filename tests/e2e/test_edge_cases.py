"""Replies, commands and outcomes at the edges: each a named, counted failure or a clear refusal,
never a raw exception (issue 19)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from eagleops.pipeline.engine import Engine
from eagleops.pipeline.generate.replies import MalformedReply, parse_reply
from tests.conftest import make_config, read_jsonl, write_jsonl


def _reply(content: str = "fine", reasoning: str | None = None, usage: object = None) -> bytes:
    message: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    payload: dict = {"choices": [{"message": message, "finish_reason": "stop"}]}
    if usage is not None:
        payload["usage"] = usage
    return json.dumps(payload).encode()  # json escapes a lone surrogate as \ud800: what a broken server sends


@pytest.mark.parametrize(
    "raw,why",
    [
        (_reply(usage="12"), "usage is a str"),
        (_reply(usage=[1, 2]), "usage is a list"),
        (_reply(content="half \ud800 a pair"), "content is not valid Unicode"),
        (_reply(reasoning="thought \udfff"), "reasoning is not valid Unicode"),
    ],
)
def test_an_odd_reply_is_malformed_and_says_why(raw, why):
    with pytest.raises(MalformedReply, match=why):
        parse_reply(raw)


class OddServer:
    """Answers each prompt oddly on its first try, properly on the next."""

    def __init__(self, odd: bytes):
        self.odd, self.seen = odd, 0

    async def chat(self, request: web.Request) -> web.Response:
        self.seen += 1
        body = self.odd if self.seen == 1 else _reply("fine", usage={"completion_tokens": 1, "prompt_tokens": 1})
        return web.Response(body=body, content_type="application/json")


@pytest.mark.parametrize("odd", [_reply(usage="12"), _reply(content="\ud800")], ids=["usage-string", "lone-surrogate"])
async def test_an_odd_reply_is_retried_and_the_record_counts_its_attempts(tmp_path, odd):
    server = OddServer(odd)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        source = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "hello"}])
        config = make_config(tmp_path, f"http://127.0.0.1:{port}/v1", [{"name": "A", "path": str(source), "token_budget": "1M"}])
        summary = await Engine(config).run()
    finally:
        await runner.cleanup()
    [record] = read_jsonl(tmp_path / "out" / "A" / "data.jsonl")
    assert summary.ok and record["attempts"] == 2 and record["conversations"][-1]["content"] == "fine"


@pytest.mark.parametrize(
    "tokens,needle",
    [
        (10**32, "past any real budget"),
        (-5, "must not be negative"),
        (1.5, "not a whole token count"),
        (True, "not a token count"),
        (None, "missing"),
        ("lots", "not a token count"),
    ],
)
def test_the_socket_reads_a_budget_as_the_run_file_does(tokens, needle):
    from eagleops.pipeline.protocol.events import command_from_json

    with pytest.raises(ValueError, match=f"budget: tokens: .*{needle}"):
        command_from_json({"cmd": "budget", "dataset": "A", "tokens": tokens})
    assert command_from_json({"cmd": "budget", "dataset": "A", "tokens": "10M"}).tokens == 10_000_000


def _headless_run(tmp_path, base_url: str) -> list[str]:
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"s{i}", "prompt": f"x {i} [[tokens:5]] [[delay:0.05]]"} for i in range(400)])
    run = tmp_path / "run.toml"
    run.write_text(
        f'name = "{tmp_path.name[:20]}"\noutput_dir = "out"\nconcurrency = 2\n[[endpoints]]\nbase_url = "{base_url}"\nmodel = "m"\n'
        f'[[datasets]]\nname = "S"\npath = "{source}"\ntoken_budget = "1G"\n'
    )
    return [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))


@contextlib.contextmanager
def _started(command: list[str]) -> Iterator[subprocess.Popen]:
    """The run in the background, killed whatever the test does."""
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# From its first Python line (about 50 ms after exec: the interpreter's own start comes first).
@pytest.mark.parametrize("after_s", [0.15, 0.3, 0.6])
def test_a_hangup_in_its_first_second_leaves_a_headless_run_going(tmp_path, fault_server, after_s):
    with _started(_headless_run(tmp_path, fault_server.base_url)) as proc:
        time.sleep(after_s)
        proc.send_signal(signal.SIGHUP)
        data, deadline = tmp_path / "out" / "S" / "data.jsonl", time.monotonic() + 60
        while (data.read_bytes().count(b"\n") if data.exists() else 0) < 20:  # the run goes on past the hangup, saving
            assert proc.poll() is None, f"a hangup {after_s}s in ended the run: exit {proc.returncode}"
            assert time.monotonic() < deadline, "the run made nothing after the hangup"
            time.sleep(0.1)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130


@pytest.mark.parametrize("after_s", [0.15, 0.4])
def test_sigterm_before_the_engine_is_up_is_the_clean_kill(tmp_path, fault_server, after_s):
    with _started(_headless_run(tmp_path, fault_server.base_url)) as proc:
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130


async def test_a_run_whose_rows_all_failed_does_not_exit_0_and_says_which(tmp_path, fault_server):
    from eagleops.pipeline.errors import ExitCode
    from eagleops.pipeline.protocol.events import LogEvent

    failing = write_jsonl(tmp_path / "f.jsonl", [{"id": f"f{i}", "prompt": f"x {i} [[fault:400]]"} for i in range(5)])
    fine = write_jsonl(tmp_path / "g.jsonl", [{"id": f"g{i}", "prompt": f"y {i} [[tokens:3]]"} for i in range(5)])
    datasets = [{"name": "F", "path": str(failing), "token_budget": "1M"}, {"name": "G", "path": str(fine), "token_budget": "1M"}]
    engine = Engine(make_config(tmp_path, fault_server.base_url, datasets))
    subscription = engine.subscribe()
    summary = await engine.run()
    lines = [e.message async for e in subscription if isinstance(e, LogEvent)]
    assert summary.exit_code == ExitCode.SHORTFALL and summary.shortfalls() == ["F: nothing written (5 rows failed)"]
    assert any("F: nothing written" in line and "exits with code 3" in line for line in lines)


async def test_a_dataset_mostly_failed_passes_max_failed_share_and_a_few_failures_do_not(tmp_path, fault_server):
    from eagleops.pipeline.errors import ExitCode

    rows = [{"id": f"r{i}", "prompt": f"x {i} " + ("[[fault:400]]" if i < 3 else "[[tokens:3]]")} for i in range(10)]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    dataset = [{"name": "A", "path": str(source), "token_budget": "1M"}]
    strict = await Engine(make_config(tmp_path / "strict", fault_server.base_url, dataset, max_failed_share=0.2)).run()
    assert strict.exit_code == ExitCode.SHORTFALL and "3 of 10 rows failed (over max_failed_share 0.2)" in strict.shortfalls()[0]
    lenient = await Engine(make_config(tmp_path / "lenient", fault_server.base_url, dataset, max_failed_share=0.5)).run()
    assert lenient.exit_code == ExitCode.OK


def test_a_retry_kind_is_cut_between_words_not_mid_number():
    from eagleops.pipeline.generate.digest import reason_kind

    kind = reason_kind("reply of 33554433 bytes is over the 33554432-byte limit (retry.max_reply_mb)")
    assert kind == "reply of 33554433 bytes is over the..." and len(kind) <= 40
    assert reason_kind("HTTP 503: busy") == "HTTP 503" and reason_kind("short one") == "short one"


def test_regenerate_all_holds_the_budget_bound_across_kill_9(tmp_path, fault_server):
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                m
                for k in range(8)
                for m in ({"role": "user", "content": f"q{k} {i} [[tokens:30]] [[delay:0.05]]"}, {"role": "assistant", "content": "old"})
            ],
        }
        for i in range(60)
    ]
    command = _headless_run(tmp_path, fault_server.base_url)
    run = Path(command[-2])
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    text = (
        run.read_text()
        .replace('token_budget = "1G"', 'token_budget = 900\nregenerate = "all"')
        .replace("concurrency = 2", "concurrency = 8")
    )
    run.write_text(text + "[sampling]\nmax_tokens = 64\n")
    assert f'path = "{source}"' in run.read_text()
    for delay in (0.9, 1.3, 1.1):
        proc = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(delay)
        finally:
            proc.kill()
            proc.wait()
    final = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stdout[-2000:]
    records = read_jsonl(tmp_path / "out" / "S" / "data.jsonl")
    written = sum(r["completion_tokens"] for r in records)
    assert 900 <= written <= 900 + 8 * 64
    assert len({r["id"] for r in records}) == len(records)


async def test_closing_the_socket_under_an_attached_console_reports_no_error(tmp_path):
    """An engine that ends while a console streams its events: the connection just ends."""
    from eagleops.pipeline.protocol.control import ControlClient, ControlServer, socket_path_for

    config = make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "A", "path": str(tmp_path / "a.jsonl"), "token_budget": 1}])
    engine = Engine(config, stages=())
    reported: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
    server = ControlServer(engine, socket_path_for(config.name, tmp_path))
    await server.start()
    client = ControlClient(server.path)
    stream = client.events()
    await anext(stream)  # streaming: the server's handler waits on the bus
    await server.close()
    await client.close()
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert reported == []


async def test_an_attached_console_hears_why_the_run_exits_as_it_does(tmp_path, fault_server):
    """The engine's last words (here: why it exits with code 3) reach a console over the socket,
    though the socket closes as soon as the engine has ended."""
    from eagleops.pipeline.protocol.control import ControlClient, ControlServer, socket_path_for
    from eagleops.pipeline.protocol.events import LogEvent

    source = write_jsonl(tmp_path / "bad.jsonl", [{"id": f"b{i}", "prompt": f"y {i} [[fault:400]]"} for i in range(3)])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "BAD", "path": str(source), "token_budget": "5k"}])
    engine = Engine(config)
    await engine.open()
    server = ControlServer(engine, socket_path_for(config.name, config.output_dir))
    await server.start()
    client = ControlClient(server.path)
    stream = client.events()
    await anext(stream)
    heard: list[str] = []

    async def listen() -> None:
        async for event in stream:
            if isinstance(event, LogEvent):
                heard.append(event.message)

    listener = asyncio.create_task(listen())
    await engine.run()
    await server.close()  # as `eagleops run --no-tui` does, right after the run
    await asyncio.wait_for(listener, 10)
    await client.close()
    assert any("BAD: nothing written" in line and "exits with code 3" in line for line in heard)
