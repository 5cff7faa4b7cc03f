"""OpenAI-compatible chat client: load-balanced endpoints, retries with backoff, usage accounting.

Works against SGLang, vLLM, OpenRouter and ``transformers serve`` (all speak
``POST /v1/chat/completions``). Cancelling a call closes its connection, so the server sees the
client go away and stops generating (both SGLang and vLLM abort on disconnect).
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from eagleops.pipeline.config import RetryConfig, SamplingConfig
from eagleops.pipeline.errors import EagleOpsError
from eagleops.pipeline.generate.capture import CaptureRef, capture_refs, new_mark
from eagleops.pipeline.generate.endpoints import EndpointPool, EndpointState, RateMeter
from eagleops.pipeline.generate.replies import MalformedReply, Reply, parse_reply, request_fields
from eagleops.pipeline.protocol.redact import Redactor

__all__ = [
    "ChatClient",
    "Completion",
    "EndpointPool",
    "PermanentFailure",
    "RateMeter",
    "TokenCounter",
    "retry_after_seconds",
]

_ERROR_BODY_READ = 64 * 1024  # of an error reply: redacted whole, then cut to _ERROR_SNIPPET
_ERROR_SNIPPET = 300

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524}


class PermanentFailure(EagleOpsError):
    """The record cannot be completed: recorded in failed.jsonl with this reason."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(reason)
        self.reason, self.attempts = reason, attempts


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int
    usage_source: str  # "server" | "tokenizer" | "estimate"
    endpoint: str
    latency_s: float
    attempts: int
    cost: float | None = None
    reasoning: str | None = None
    reasoning_tokens: int = 0  # of completion_tokens; the server's count, else estimated
    token_ids: tuple[int, ...] | None = None
    # a regenerated conversation's record: every reply's ids, in order (the last is token_ids)
    reply_token_ids: tuple[tuple[int, ...] | None, ...] = ()
    prompt_ids: tuple[int, ...] | None = None  # what the server fed the target, where it says
    reply_prompt_ids: tuple[tuple[int, ...] | None, ...] = ()  # each reply's, for a regenerated conversation
    tool_calls: tuple[dict[str, Any], ...] = ()
    capture_mark: str | None = None  # where the serving target kept its hidden states (during_generate)
    reply_capture_marks: tuple[str | None, ...] = ()  # each reply's, for a regenerated conversation

    def captured_replies(self) -> tuple[CaptureRef, ...]:
        """The replies the serving target captured, each with the sequence it processed."""
        if self.reply_capture_marks:
            return tuple(capture_refs(self.reply_capture_marks, self.reply_prompt_ids, self.reply_token_ids))
        return tuple(capture_refs((self.capture_mark,), (self.prompt_ids,), (self.token_ids,)))


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Retry-After is either delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (now if now is not None else time.time()))


class TokenCounter:
    """Counts completion tokens locally when a server reports no usage."""

    def __init__(self, tokenizer_path: Path | None):
        self.path = tokenizer_path
        self._tokenizer: Any = None

    @property
    def available(self) -> bool:
        return self.path is not None

    def _load(self) -> Any:
        if self._tokenizer is None:
            if self.path is None:
                raise RuntimeError("TokenCounter without a tokenizer path")  # callers check .available
            # tokenizer.json through `tokenizers` alone: no transformers, so no torch in generate
            file = self.path if self.path.is_file() else self.path / "tokenizer.json"
            if file.is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(file))
                self._tokenizer = lambda text: len(tok.encode(text, add_special_tokens=False).ids)
            else:  # a tokenizer with no tokenizer.json (sentencepiece or tiktoken files)
                from transformers import AutoTokenizer

                slow = AutoTokenizer.from_pretrained(str(self.path))
                self._tokenizer = lambda text: len(slow.encode(text, add_special_tokens=False))
        return self._tokenizer

    def count(self, text: str) -> int:
        """Blocking (tokenizer load + encode): call through asyncio.to_thread."""
        return self._load()(text)


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4)) if text else 0


class ChatClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: EndpointPool,
        sampling: SamplingConfig,
        retry: RetryConfig,
        counter: TokenCounter,
        *,
        rng: random.Random | None = None,
        redact: Redactor | None = None,
    ):
        self.session, self.pool, self.sampling, self.retry, self.counter = session, pool, sampling, retry, counter
        self.rng = rng or random.Random()
        self.redact = redact or Redactor([])
        self.max_reply_bytes = int(retry.max_reply_mb * 2**20)
        self.on_warning: Callable[[str], None] | None = None  # a server's numbers not trusted
        self._timeout = aiohttp.ClientTimeout(total=retry.timeout_s, sock_connect=min(30.0, retry.timeout_s))
        self.on_retry: Callable[[str, str, float], None] | None = None  # (endpoint, reason, delay), for the log
        self.capturing: str | None = None  # the label of the endpoint whose requests are captured (during_generate)

    def _body(
        self,
        endpoint: EndpointState,
        messages: tuple[dict[str, Any], ...],
        thinking: str,
        tools: tuple[dict[str, Any], ...] | None = None,
        max_tokens: int | None = None,
    ) -> bytes:
        ep = endpoint.config
        body = {
            "model": ep.model,
            "messages": list(messages),
            "max_tokens": max_tokens or self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "stream": False,
            **request_fields(
                self.sampling.extra,
                kind=ep.kind,
                base_url=ep.base_url,
                thinking=thinking,
                template_switch=self.sampling.thinking_off_kwargs,
                template_on=self.sampling.thinking_on_kwargs,
            ),
        }
        if tools:  # the row's tool schemas: the server's template renders them as the target always sees them
            body["tools"] = list(tools)
            if ep.kind in ("vllm", "sglang"):  # "auto" needs a tool-call parser flag on the server; "none" still renders them
                body.setdefault("tool_choice", "none")
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.retry.max_delay_s, self.retry.base_delay_s * (2 ** (attempt - 1)))
        delay = self.rng.uniform(0.0, ceiling)  # full jitter: retries of a burst spread out
        if retry_after is not None:  # honoured, but never past our own ceiling: a slot held a day is a hang
            delay = max(delay, min(retry_after, self.retry.max_delay_s))
        return delay

    async def complete(
        self,
        messages: tuple[dict[str, Any], ...],
        *,
        thinking: str = "keep",
        tools: tuple[dict[str, Any], ...] | None = None,
        max_tokens: int | None = None,
    ) -> Completion:
        """The target's reply; ``max_tokens``: this request's ceiling, if lower than the run's."""
        started = time.monotonic()
        attempt = 0
        previous: EndpointState | None = None
        while True:
            attempt += 1
            endpoint = await self.pool.acquire(avoid=previous)
            sent_at = self.pool.clock()
            try:
                reply = await self._attempt(endpoint, messages, thinking, tools, max_tokens)
                self.pool.succeeded(endpoint)
                break
            except _Retryable as exc:
                retry_after = min(exc.retry_after, self.retry.max_delay_s) if exc.retry_after is not None else None
                self.pool.failed(endpoint, exc.reason, retry_after, sent_at)
                if attempt >= self.retry.max_attempts:
                    raise PermanentFailure(f"{exc.reason} (gave up after {attempt} attempts)", attempt) from None
                # another healthy endpoint takes the retry after at most the first backoff (not the
                # growing one: that is for the endpoint that failed); without one, the full backoff
                delay = self.backoff(attempt, retry_after)
                if self.pool.healthy_other_than(endpoint):
                    delay = min(delay, self.retry.base_delay_s)
                if self.on_retry is not None:
                    self.on_retry(endpoint.config.label, exc.reason, delay)
            except PermanentFailure as exc:
                endpoint.errors += 1
                raise PermanentFailure(exc.reason, attempt) from None
            finally:
                self.pool.release(endpoint)
            previous = endpoint
            await asyncio.sleep(delay)
        completion_tokens, source = self._trusted_count(reply, endpoint), "server"
        generated = (reply.reasoning or "") + reply.text
        if completion_tokens is None:
            if self.counter.available:
                completion_tokens = await asyncio.to_thread(self.counter.count, generated)
                source = "tokenizer"
            else:
                completion_tokens = estimate_tokens(generated)
                source = "estimate"
        endpoint.meter.add(completion_tokens)  # after any local count, so tok/s includes it
        return Completion(
            text=reply.text,
            finish_reason=reply.finish_reason,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=completion_tokens,
            usage_source=source,
            endpoint=endpoint.config.label,
            latency_s=time.monotonic() - started,
            attempts=attempt,
            cost=reply.cost,
            reasoning=reply.reasoning,
            reasoning_tokens=_reasoning_share(reply, completion_tokens),
            token_ids=reply.token_ids,
            tool_calls=reply.tool_calls,
            prompt_ids=reply.prompt_ids,
            capture_mark=reply.capture_mark,
        )

    def _trusted_count(self, reply: Reply, endpoint: EndpointState) -> int | None:
        """The server's completion_tokens, unless no server could have generated that many: then
        None, and the reply is counted here (a bad count would spend or fake a whole budget)."""
        count = reply.completion_tokens
        limit = 2 * self.sampling.max_tokens + 16  # slack for servers that count thinking apart
        if count is None or count <= limit:
            return count
        if self.on_warning is not None:
            self.on_warning(
                f"{endpoint.config.label}: reported {count} completion tokens for max_tokens {self.sampling.max_tokens}; counted locally"
            )
        return None

    async def _attempt(
        self,
        endpoint: EndpointState,
        messages: tuple[dict[str, Any], ...],
        thinking: str,
        tools: tuple[dict[str, Any], ...] | None,
        max_tokens: int | None,
    ) -> Reply:
        headers = {"Content-Type": "application/json"}
        if endpoint.key:
            headers["Authorization"] = f"Bearer {endpoint.key}"
        mark = new_mark() if endpoint.config.label == self.capturing else None
        if mark is not None:  # vLLM names the request after it: the capture keeps its rows under it
            headers["X-Request-Id"] = mark
        sent = time.monotonic()
        response = None
        try:
            response = await self.session.post(
                endpoint.url, data=self._body(endpoint, messages, thinking, tools, max_tokens), headers=headers, timeout=self._timeout
            )
            limit = _ERROR_BODY_READ if response.status != 200 else self.max_reply_bytes
            raw = await _read_capped(response, limit, truncate=response.status != 200)
        except TimeoutError:
            raise _Retryable(f"timed out after {self.retry.timeout_s:g}s") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Retryable(f"connection error: {type(exc).__name__}: {exc}") from None
        except BaseException:
            if response is not None:
                response.close()  # cancelled: drop the connection so the server stops generating
            raise
        finally:
            if response is not None:
                response.release()
        status = response.status
        if status != 200:
            snippet = self.redact(raw.decode("utf-8", "replace")).strip()[:_ERROR_SNIPPET]
            reason = f"HTTP {status}: {snippet}" if snippet else f"HTTP {status}"
            if status in _RETRY_STATUS:
                raise _Retryable(reason, retry_after_seconds(response.headers.get("Retry-After")))
            raise PermanentFailure(reason, 1)
        try:
            reply = parse_reply(raw)
        except MalformedReply as exc:
            raise _Retryable(str(exc)) from None
        endpoint.requests += 1
        endpoint.latencies.append(time.monotonic() - sent)
        return dataclasses.replace(reply, capture_mark=mark) if mark is not None else reply


async def _read_capped(response: aiohttp.ClientResponse, limit: int, *, truncate: bool) -> bytes:
    """The body, but never more than ``limit`` bytes in memory: a larger error body is cut, a
    larger reply is refused (a runaway server cannot take the engine's memory)."""
    declared = response.content_length
    if declared is not None and declared > limit and not truncate:
        raise _Retryable(f"reply of {declared} bytes is over the {limit}-byte limit (retry.max_reply_mb)")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if truncate:
                break
            raise _Retryable(f"reply over the {limit}-byte limit (retry.max_reply_mb)")
    return b"".join(chunks)[:limit] if truncate else b"".join(chunks)


def _reasoning_share(reply: Reply, completion_tokens: int) -> int:
    """The server's reasoning token count, else the thinking's share of the characters."""
    if reply.reasoning_tokens is not None:
        return min(reply.reasoning_tokens, completion_tokens)
    if not reply.reasoning:
        return 0
    return round(completion_tokens * len(reply.reasoning) / (len(reply.reasoning) + len(reply.text)))
