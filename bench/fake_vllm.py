"""A stand-in for vLLM's OpenAI server: what eagleops' supervisor and generate stage meet, with no
GPU and no vLLM. The fault storm and the tests of server lifetimes start it where vLLM would go.

It takes vLLM's command line (``-m vllm.entrypoints.openai.api_server --model M --port P ...``,
what it does not know it ignores), so a two-line shell script named as ``serve.python`` runs it.
Like vLLM, which starts an engine core process, it starts a child (a ``sleep``) in its own
process group: a supervisor that stops only the process it started leaves that child behind. The
child's environment holds nothing of the server's (vLLM's setproctitle writes over it).

It serves ``/health``, ``/v1/models`` and ``/v1/chat/completions`` (a canned reply of
``--tokens`` words after ``--latency`` seconds) and ``POST /admin/crash`` (exits at once, its child
left running, as a crashed vLLM leaves its workers). With ``$FAKE_VLLM_PIDS`` set to a folder, it
writes ``<pid>.json`` there naming itself and its child, so a test can count what survives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PIDS_ENV = "FAKE_VLLM_PIDS"


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-vllm"
    model = "target"
    tokens = 8
    latency_s = 0.0

    def log_message(self, format: str, *args: object) -> None:
        pass  # a request per line would bury the lines a test looks for

    def _json(self, payload: dict, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({})
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 4096}]})
        else:
            self._json({"error": {"message": f"no route {self.path}"}}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path == "/admin/crash":
            os._exit(17)  # no cleanup, no reply: the child stays, as a crashed vLLM's workers do
        if self.path != "/v1/chat/completions":
            self._json({"error": {"message": f"no route {self.path}"}}, 404)
            return
        time.sleep(self.latency_s)
        text = " ".join(["word"] * self.tokens)
        self._json(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens},
            }
        )


def _record(child: subprocess.Popen[bytes]) -> None:
    folder = os.environ.get(PIDS_ENV)
    if not folder:
        return
    path = Path(folder) / f"{os.getpid()}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"server": os.getpid(), "child": child.pid, "group": os.getpgrp()}))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="target")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.05)
    args, _ = parser.parse_known_args(argv)
    if args.host != "127.0.0.1":
        raise SystemExit(f"refusing to listen on {args.host}: loopback only")
    _Handler.model, _Handler.tokens, _Handler.latency_s = args.served_model_name, args.tokens, args.latency
    # the "engine core": in the same process group, it outlives a crash; its environment holds
    # none of ours, as vLLM's engine core and workers show none once setproctitle writes over it
    marker = {key: os.environ[key] for key in ("PATH", PIDS_ENV) if key in os.environ}
    child = subprocess.Popen(["sleep", "3600"], env=marker)
    _record(child)
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    server.daemon_threads = True
    print(f"INFO fake vLLM serving {args.served_model_name} on http://{args.host}:{args.port}", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child.wait()  # the main thread waits; SIGTERM's default action ends the server, not the child


if __name__ == "__main__":
    main(sys.argv[1:])
