"""A fast OpenAI-compatible loopback server with canned answers and injected faults.

Faults are asked for in the prompt text, so a test decides exactly what each record meets:

    [[fault:500x2]]      two HTTP 500s, then success (per prompt; also 502/503/400/401...)
    [[fault:429x1]]      one 429 with ``Retry-After`` (``retry_after`` query/CLI default 0.2s)
    [[fault:resetx1]]    headers and half a body, then the connection is cut
    [[fault:malformedx1]] HTTP 200 with a body that is not JSON
    [[fault:stall]]      never answers; counts the client's disconnect
    [[fault:nousage]]    success without ``usage``
    [[fault:oddusagex1]] HTTP 200 whose ``usage`` is a string, not an object
    [[fault:surrogatex1]] HTTP 200 whose content holds a lone surrogate (``\ud800``)
    [[fault:echo-auth]]  HTTP 400 whose body echoes the Authorization header (redaction test);
                         ``echo-auth-late`` echoes it across byte 300, ``echo-auth-json`` with
                         every ``-`` escaped as ``\u002d``, ``echo-auth-200`` in a reply's content
    [[usage:F=V]]        report usage field F as the raw JSON value V (``completion_tokens=1e15``,
                         ``prompt_tokens=-5``, ``cost=NaN``): a server's numbers are not trusted
    [[bigreply:MB]]      a 200 reply of about MB megabytes
    [[tokens:N]]         answer with N completion tokens (N words)
    [[delay:S]]          answer after S seconds
    [[cost:X]]           report ``usage.cost`` = X dollars, as OpenRouter does
    [[think:FORM]]       a reasoning model's reply: its thinking in ``message.reasoning`` (vLLM,
                         OpenRouter), ``message.reasoning_content`` (SGLang), ``inline``
                         (``<think>..</think>`` in content) or ``opened`` (``..</think>`` in
                         content: the prompt opened the block), with ``reasoning_tokens`` in usage;
                         none when the request turns thinking off (counted in ``thinking_off``,
                         and by switch in ``thinking_off_enable_thinking`` / ``_thinking`` /
                         ``_reasoning_effort``); a request turning it on by a template switch
                         is counted in ``thinking_on_enable_thinking`` / ``_thinking``

``--fault-rate`` adds random transient faults (500, 429, reset, malformed) to any request.
A reply never has more tokens than the request's ``max_tokens`` (it is cut there, with
``finish_reason`` "length", as every server cuts it).
``GET /admin/stats`` reports requests, completions, disconnects, peak concurrency and the
``max_tokens`` requests asked for.

    python -m eagleops.pipeline.testservers.fault --port 0 --port-file PORT
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import time

from aiohttp import web

from eagleops.pipeline.servers.common import LOOPBACK, client_gone, serve_forever

_DIRECTIVE = re.compile(r"\[\[(fault|tokens|delay|cost|think|usage|bigreply):([^\]]+)\]\]")
_ALWAYS = ("stall", "echo-auth", "echo-auth-late", "echo-auth-json")  # faults that never clear
_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box".split()


class FaultServer:
    def __init__(self, *, tokens: int = 32, latency_s: float = 0.0, fault_rate: float = 0.0, retry_after: float = 0.2, seed: int = 0):
        self.default_tokens, self.latency_s, self.fault_rate, self.retry_after = tokens, latency_s, fault_rate, retry_after
        self.rng = random.Random(seed)
        self.attempts: dict[str, int] = {}
        self.stats = {"requests": 0, "completed": 0, "disconnects": 0, "in_flight": 0, "max_in_flight": 0, "faults": 0, "thinking_off": 0}
        # which switch turned it off: templates read different ones (Qwen3 enable_thinking, Kimi thinking)
        self.stats.update({f"thinking_off_{switch}": 0 for switch in (*_TEMPLATE_SWITCHES, "reasoning_effort")})
        self.stats.update({f"thinking_on_{switch}": 0 for switch in _TEMPLATE_SWITCHES})
        self._canned: dict[tuple[int, str], bytes] = {}
        self.max_tokens_asked: dict[int, int] = {}  # max_tokens -> requests that asked for it

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/admin/stats", self.admin_stats)
        app.router.add_post("/admin/reset", self.admin_reset)
        app.router.add_get("/health", _healthy)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fault-model", "object": "model", "max_model_len": 4096}]})

    async def admin_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "max_tokens_asked": self.max_tokens_asked})

    async def admin_reset(self, request: web.Request) -> web.Response:
        self.attempts.clear()
        self.max_tokens_asked.clear()
        for key in self.stats:
            self.stats[key] = 0
        return web.json_response({"ok": True})

    def _answer(self, tokens: int, usage: bool, prompt_tokens: int, finish: str = "stop") -> bytes:
        if usage and (tokens, finish) in self._canned:
            return self._canned[tokens, finish]
        text = " ".join(_WORDS[i % len(_WORDS)] for i in range(tokens))
        payload = {
            "id": "chatcmpl-canned",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "fault-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        }
        if usage:
            payload["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        body = json.dumps(payload).encode()
        if usage:
            self._canned[tokens, finish] = body
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        self.stats["in_flight"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])
        try:
            return await self._chat(request)
        finally:
            self.stats["in_flight"] -= 1

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = request_body = json.loads(raw)
            messages = body["messages"]
            text = messages[-1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return web.json_response({"error": {"message": "bad request body"}}, status=400)
        directives = _DIRECTIVE.findall(text)
        key = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        attempt = self.attempts[key] = self.attempts.get(key, 0) + 1
        tokens, usage, delay, cost = self.default_tokens, True, self.latency_s, None
        fault: str | None = None
        for kind, arg in directives:
            if kind == "tokens":
                tokens = int(arg)
            elif kind == "delay":
                delay = float(arg)
            elif kind == "cost":
                cost = float(arg)
            elif kind == "fault":
                name, _, times = arg.partition("x")
                if arg == "nousage":
                    usage = False
                elif arg in _ALWAYS or not times or attempt <= int(times):
                    fault = arg if arg in _ALWAYS else name
        if fault == "echo-auth-200":  # the key comes back in a successful reply
            fault = None
            tokens = 0
            directives.append(("echo", request.headers.get("Authorization", "")))
        if fault is None and self.fault_rate and self.rng.random() < self.fault_rate:
            fault = self.rng.choice(["500", "429", "reset", "malformed"])
        if delay:
            await asyncio.sleep(delay)
        if fault is not None:
            self.stats["faults"] += 1
            return await self._fault(request, fault)
        self.stats["completed"] += 1
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)
        asked = request_body.get("max_tokens")
        finish = "stop"
        if isinstance(asked, int):
            self.max_tokens_asked[asked] = self.max_tokens_asked.get(asked, 0) + 1
            if tokens > asked:
                tokens, finish = asked, "length"
        body = self._answer(tokens, usage, prompt_tokens, finish)
        if cost is not None:
            payload = json.loads(body)
            payload["usage"]["cost"] = cost
            body = json.dumps(payload).encode()
        think = next((arg for kind, arg in directives if kind == "think"), None)
        if switch := _thinking_off(request_body):
            self.stats["thinking_off"] += 1
            if f"thinking_off_{switch}" in self.stats:
                self.stats[f"thinking_off_{switch}"] += 1
            if switch != "reasoning_effort":  # a low effort still thinks (gpt-oss cannot stop)
                think = None
        for name in _TEMPLATE_SWITCHES:
            self.stats[f"thinking_on_{name}"] += (request_body.get("chat_template_kwargs") or {}).get(name) is True
        if think is not None:
            body = _with_thinking(body, think)
        if edits := [(kind, arg) for kind, arg in directives if kind in ("usage", "bigreply", "echo")]:
            body = _edited(body, edits)
        return web.Response(body=body, content_type="application/json")

    async def _fault(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault == "stall":
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if client_gone(request):
                    self.stats["disconnects"] += 1
                    break
                await asyncio.sleep(0.02)
            return web.Response(status=499)
        if fault.startswith("echo-auth"):
            message = f"bad key: {request.headers.get('Authorization', '')}"
            if fault == "echo-auth-late":
                message = "x" * 250 + message  # the key straddles byte 300, where snippets are cut
            text = json.dumps({"error": {"message": message}})
            if fault == "echo-auth-json":
                text = text.replace("-", "\\u002d")
            return web.Response(text=text, status=400, content_type="application/json")
        if fault == "429":
            return web.json_response({"error": {"message": "rate limited"}}, status=429, headers={"Retry-After": f"{self.retry_after:g}"})
        if fault == "malformed":
            return web.Response(body=b'{"choices": [ this is not json', content_type="application/json")
        if fault in ("oddusage", "surrogate"):  # valid JSON, but not a reply anyone can record
            content, usage = ("fine", '"12"') if fault == "oddusage" else ("half a pair \\ud800", '{"completion_tokens": 3}')
            body = f'{{"choices": [{{"message": {{"role": "assistant", "content": "{content}"}}, "finish_reason": "stop"}}], "usage": {usage}}}'
            return web.Response(body=body.encode(), content_type="application/json")
        if fault == "reset":
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "4096"})
            await response.prepare(request)
            await response.write(b'{"id": "chatcmpl-cut", "choices": [{"index": 0, "mess')
            if request.transport is not None:
                request.transport.abort()
            return response
        if fault.isdigit():
            return web.json_response({"error": {"message": f"injected {fault}"}}, status=int(fault))
        return web.json_response({"error": {"message": f"unknown fault {fault!r}"}}, status=400)


def _edited(body: bytes, edits: list[tuple[str, str]]) -> bytes:
    payload = json.loads(body)
    message = payload["choices"][0]["message"]
    for kind, arg in edits:
        if kind == "usage":
            name, _, raw = arg.partition("=")
            payload.setdefault("usage", {})[name] = json.loads(raw)  # NaN too: Python's json reads it
        elif kind == "bigreply":
            message["content"] += " pad" * int(float(arg) * 2**20 / 4)
        elif kind == "echo":
            message["content"] += f" you sent {arg}"
    return json.dumps(payload).encode()


_THOUGHT = "first I weigh the cases then I check the sum"


_TEMPLATE_SWITCHES = ("enable_thinking", "thinking")


def _thinking_off(body: dict) -> str | None:
    """How the request turns thinking off, if it does: a chat-template switch (vLLM, SGLang;
    named as the template reads it) or OpenRouter's ``reasoning.enabled``."""
    template = body.get("chat_template_kwargs") or {}
    reasoning = body.get("reasoning") or {}
    switch = next((name for name in _TEMPLATE_SWITCHES if template.get(name) is False), None)
    if switch is None and body.get("reasoning_effort") == "low" and template.get("reasoning_effort") == "low":
        switch = "reasoning_effort"  # gpt-oss: the OpenAI field and the template's, both sent
    return switch or ("reasoning.enabled" if reasoning.get("enabled") is False else None)


def _with_thinking(body: bytes, form: str) -> bytes:
    payload = json.loads(body)
    message = payload["choices"][0]["message"]
    if form == "inline":
        message["content"] = f"<think>{_THOUGHT}</think>\n\n{message['content']}"
    elif form == "opened":  # no parser, and the generation prompt opened the block (R1, V3.1, Kimi)
        message["content"] = f"{_THOUGHT}</think>{message['content']}"
    else:
        message[form] = _THOUGHT
    thought_tokens = len(_THOUGHT.split())
    usage = payload.get("usage")
    if usage is not None:
        usage["completion_tokens"] += thought_tokens
        usage["total_tokens"] += thought_tokens
        usage["completion_tokens_details"] = {"reasoning_tokens": thought_tokens}
    return json.dumps(payload).encode()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per answer")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--retry-after", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    server = FaultServer(
        tokens=args.tokens, latency_s=args.latency, fault_rate=args.fault_rate, retry_after=args.retry_after, seed=args.seed
    )
    serve_forever(server.app(), args.host, args.port, args.port_file)


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


if __name__ == "__main__":
    main()
