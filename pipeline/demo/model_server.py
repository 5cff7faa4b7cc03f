"""An OpenAI-compatible server for a local transformers model, on loopback.

Requests are batched dynamically: a worker thread takes what is queued (up to ``--max-batch``),
left-pads, and runs one ``generate`` for the batch, so the event loop never blocks on torch.
Messages reach the chat template as vLLM hands them over (tool-call arguments as objects), and
every reply carries the prompt's and the reply's token ids, as vLLM's ``return_token_ids`` does.
A request whose client disconnects is dropped, and a batch whose clients all left stops early.
``/metrics`` speaks vLLM's metric names, so the console's server pane reads it like vLLM.

    python -m eagleops.pipeline.demo.model_server --model DIR --port 0 --port-file PORT
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from aiohttp import web

from eagleops.pipeline.formats.engine_messages import as_engine_renders
from eagleops.pipeline.servers.common import LOOPBACK, serve_forever, wait_unless_disconnected


@dataclass
class _Job:
    input_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: threading.Event = field(default_factory=threading.Event)


def reply_stop_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a reply, as vLLM stops: generation_config's eos ids (Llama-3.1 lists
    three; Kimi lists <|im_end|> while its tokenizer's eos is [EOS]) and the tokenizer's eos."""
    listed = getattr(generation_config, "eos_token_id", None)
    stops = set(listed if isinstance(listed, list) else [] if listed is None else [listed])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


class ModelServer:
    def __init__(self, model_dir: str, *, max_batch: int = 16, threads: int | None = None, name: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eagleops.pipeline.cpus import torch_threads

        torch.set_num_threads(threads or torch_threads()[0])  # the cores it gets, not every core it sees
        self.torch = torch
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)  # transformers' own types are too loose to check against
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.name = name or os.path.basename(os.path.normpath(model_dir))
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_batch = max_batch
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.running = 0  # in the batch being generated
        self.accepted = 0  # requests being served: queued, in a batch or being collected into one
        self.counters = {"prompt": 0, "generation": 0, "success": 0, "aborted": 0}
        self._worker = threading.Thread(target=self._work, name="generate", daemon=True)
        self._worker.start()

    # ---- HTTP -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", _healthy)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model", "max_model_len": self.max_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [
            f"vllm:num_requests_running {self.running}",
            # every request not in the batch being generated waits, the batch being collected too
            f"vllm:num_requests_waiting {max(0, self.accepted - self.running)}",
            "vllm:kv_cache_usage_perc 0.0",
            f"vllm:prompt_tokens_total {self.counters['prompt']}",
            f"vllm:generation_tokens_total {self.counters['generation']}",
            f"vllm:request_success_total {self.counters['success']}",
            f"eagleops_server:aborted_requests_total {self.counters['aborted']}",
            "eagleops_server:info 1",  # the console names this server as ours, not as vLLM
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": {"message": f"bad request: {exc}", "type": "invalid_request_error"}}, status=400)
        try:
            ids = self.tokenizer.apply_chat_template(as_engine_renders(messages), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        except Exception as exc:
            return web.json_response({"error": {"message": f"chat template failed: {exc}"}}, status=400)
        ids = list(ids)
        if len(ids) + 1 > self.max_len:
            return web.json_response(
                {"error": {"message": f"prompt of {len(ids)} tokens exceeds max_model_len {self.max_len}"}}, status=400
            )
        max_tokens = max(1, min(max_tokens, self.max_len - len(ids)))
        loop = asyncio.get_running_loop()
        job = _Job(ids, max_tokens, temperature, top_p, loop, loop.create_future())
        self.jobs.put(job)
        self.accepted += 1
        try:
            result = await wait_unless_disconnected(request, asyncio.shield(job.future))
        finally:
            self.accepted -= 1
        if result is None:
            job.cancelled.set()
            self.counters["aborted"] += 1
            return web.Response(status=499)
        text, tokens, finish = result
        n_generated = len(tokens)
        self.counters["prompt"] += len(ids)
        self.counters["generation"] += n_generated
        self.counters["success"] += 1
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "token_ids": tokens}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n_generated, "total_tokens": len(ids) + n_generated},
                "prompt_token_ids": ids,
            }
        )

    # ---- the generation thread ------------------------------------------------------------------
    def _take_batch(self) -> list[_Job]:
        first = self.jobs.get()
        batch = [first]
        deadline = time.monotonic() + 0.005  # a few ms lets concurrent arrivals share a batch
        while len(batch) < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if (job.temperature, job.top_p) == (first.temperature, first.top_p):
                batch.append(job)
            else:
                self.jobs.put(job)  # other sampling settings: next batch
                break
        return [j for j in batch if not j.cancelled.is_set()]

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                continue
            self.running = len(batch)
            try:
                results = self._generate(batch)
            except Exception as exc:
                for job in batch:
                    job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            else:
                for job, result in zip(batch, results):
                    job.loop.call_soon_threadsafe(_set_result, job.future, result)
            finally:
                self.running = 0

    def _generate(self, batch: list[_Job]) -> list[tuple[str, list[int], str]]:
        torch = self.torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        stops = reply_stop_ids(self.model.generation_config, self.tokenizer)
        width = max(len(j.input_ids) for j in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):
            input_ids[row, width - len(job.input_ids) :] = torch.tensor(job.input_ids)
            attention[row, width - len(job.input_ids) :] = 1

        class _AllGone(StoppingCriteria):
            def __call__(self, ids, scores, **kwargs):
                gone = all(j.cancelled.is_set() for j in batch)
                return torch.full((ids.shape[0],), gone, dtype=torch.bool, device=ids.device)

        sample = batch[0].temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs.update(temperature=batch[0].temperature, top_p=batch[0].top_p, top_k=0)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=max(j.max_tokens for j in batch),
                pad_token_id=pad,
                eos_token_id=stops,
                stopping_criteria=StoppingCriteriaList([_AllGone()]),
                **kwargs,
            )
        generated = out[:, width:].tolist()
        results = []
        for job, tokens in zip(batch, generated):
            tokens = tokens[: job.max_tokens]
            finish = "length"
            if ends := [i for i, token in enumerate(tokens) if token in stops]:
                tokens = tokens[: ends[0]]
                finish = "stop"
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append((text, tokens, finish))
        return results


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local transformers model directory")
    parser.add_argument("--name", help="model id to report (default: the directory's name)")
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    server = ModelServer(args.model, max_batch=args.max_batch, threads=args.threads, name=args.name)
    serve_forever(server.app(), args.host, args.port, args.port_file)


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


if __name__ == "__main__":
    main()
