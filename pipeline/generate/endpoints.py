"""The endpoints a run sends to: least-in-flight choice, each one's concurrency cap, and health.

An endpoint that fails ``BENCH_AFTER`` times in a row (refused, reset, timed out, 5xx), or
asks for a pause with ``Retry-After``, is *benched*: no request goes to it until its backoff
ends, then a single probe does; a success puts it back. Retries go to another healthy
endpoint when there is one, so a dead server costs a few fast failures, not the records.

A server that says when it is up (vLLM and SGLang answer ``GET /health``) is asked every
``HEALTH_PROBE_S`` while benched: when /health fails and then answers again, the server has
restarted, and it is back in rotation at once, not when a bench grown long over its restart
ends. A /health that answers all along leaves the bench as it is: the server is up and its
failures are of another kind (an overload, its own Retry-After), which the backoff is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from collections import deque
from collections.abc import Callable

import aiohttp

from eagleops.pipeline.config import EndpointConfig
from eagleops.pipeline.protocol.events import EndpointStats

__all__ = ["BENCH_AFTER", "EndpointPool", "EndpointState", "RateMeter", "connection_limit"]

BENCH_AFTER = 3  # consecutive failures; a lone transient error does not bench a server
HEALTH_KINDS = ("vllm", "sglang")  # the servers that answer GET /health at their root
HEALTH_PROBE_S = 0.25  # while benched; a restarted server is back within about this
HEALTH_TIMEOUT_S = 1.0


_FDS_KEPT_FREE = 48  # for output files, the control socket and its clients, telemetry, imports


def connection_limit(concurrency: int, datasets: int) -> tuple[int, str | None]:
    """Connections the run may hold open, raising the soft open-file limit as far as the hard
    one allows: with more sockets than descriptors, output files could not be opened (EMFILE).
    Returns the limit and, when it holds back the concurrency, a warning saying so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = concurrency + _FDS_KEPT_FREE + 4 * datasets
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= want:
        return concurrency, None
    limit = max(1, soft - _FDS_KEPT_FREE - 4 * datasets)
    return (
        limit,
        f"open-file limit {soft} (ulimit -n) allows {limit} connections; requests beyond that wait for one (concurrency {concurrency})",
    )


class RateMeter:
    """Events and amounts per second over a sliding window."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self.started = clock()

    def add(self, amount: float = 0.0) -> None:
        self._events.append((self.clock(), amount))
        self._sum += amount
        self._trim()

    def _trim(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._sum -= self._events.popleft()[1]

    def restart(self) -> None:
        """Measure afresh (after a pause: its idle seconds are not this dataset's speed)."""
        self._events.clear()
        self._sum = 0.0
        self.started = self.clock()

    def rates(self) -> tuple[float, float]:
        self._trim()
        span = min(self.window_s, max(1e-9, self.clock() - self.started))
        return len(self._events) / span, self._sum / span


class EndpointState:
    __slots__ = (
        "config", "in_flight", "requests", "errors", "latencies", "meter", "key", "url", "health_url", "failures_in_a_row", "benched_until",
        "last_strike_at",
    )  # fmt: skip

    def __init__(self, config: EndpointConfig):
        self.config = config
        self.url = f"{config.base_url}/chat/completions"
        self.health_url = f"{config.base_url.removesuffix('/v1')}/health" if config.kind in HEALTH_KINDS else None
        self.key = config.api_key()
        self.in_flight = 0
        self.requests = 0
        self.errors = 0
        self.latencies: deque[float] = deque(maxlen=512)
        self.meter = RateMeter()
        self.failures_in_a_row = 0
        self.benched_until = 0.0
        self.last_strike_at = float("-inf")  # when the last failure counted in failures_in_a_row came

    def has_room(self) -> bool:
        if self.failures_in_a_row >= BENCH_AFTER:
            return self.in_flight == 0  # on probation: one probe at a time
        cap = self.config.max_concurrency
        return cap is None or self.in_flight < cap

    def benched(self, now: float) -> bool:
        return now < self.benched_until


class EndpointPool:
    def __init__(
        self,
        endpoints: tuple[EndpointConfig, ...],
        *,
        base_bench_s: float = 0.5,
        max_bench_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.endpoints = [EndpointState(ep) for ep in endpoints]
        self.base_bench_s, self.max_bench_s, self.clock = base_bench_s, max_bench_s, clock
        self.on_health: Callable[[str, str], None] | None = None  # (level, message), at each change
        self.health_probe_s = HEALTH_PROBE_S
        self._room = asyncio.Event()
        self._turn = 0
        self._probes: dict[EndpointState, asyncio.Task[None]] = {}

    async def acquire(self, avoid: EndpointState | None = None) -> EndpointState:
        """The least busy healthy endpoint, other than ``avoid`` if another can take it; waits
        while every endpoint is full or benched."""
        while True:
            now = self.clock()
            ready = [ep for ep in self.endpoints if ep.has_room() and not ep.benched(now)]
            if len(ready) > 1 and avoid in ready:
                ready.remove(avoid)
            if ready:
                least = min(ep.in_flight for ep in ready)
                ties = [ep for ep in ready if ep.in_flight == least]
                self._turn += 1
                chosen = ties[self._turn % len(ties)]
                chosen.in_flight += 1
                return chosen
            self._room.clear()
            benched = [ep.benched_until for ep in self.endpoints if ep.benched(now)]
            wait = max(0.01, min(benched) - now) if benched else None
            try:
                await asyncio.wait_for(self._room.wait(), wait)
            except TimeoutError:
                pass

    def release(self, endpoint: EndpointState) -> None:
        """Synchronous, so it also runs inside a cancelled task's cleanup."""
        endpoint.in_flight -= 1
        self._room.set()

    def succeeded(self, endpoint: EndpointState) -> None:
        if endpoint.failures_in_a_row >= BENCH_AFTER and self.on_health is not None:
            self.on_health("info", f"{endpoint.config.label}: answering again; back in rotation")
        endpoint.failures_in_a_row = 0
        endpoint.benched_until = 0.0
        self._room.set()

    def failed(self, endpoint: EndpointState, reason: str, pause_s: float | None = None, sent_at: float | None = None) -> None:
        """A transient failure; ``pause_s`` is the server's own Retry-After (already capped);
        ``sent_at`` (this pool's clock) when the failed attempt was sent.

        Only an attempt sent after the last counted failure adds to ``failures_in_a_row``: the
        requests in flight when a server hiccups fail together, and 40 of them are one failure,
        not 40 (counted one by one they benched a server that had stalled for 5 s for 30 s)."""
        endpoint.errors += 1
        counted = sent_at is None or sent_at >= endpoint.last_strike_at
        if counted:
            endpoint.failures_in_a_row += 1
            endpoint.last_strike_at = self.clock()
        strikes = endpoint.failures_in_a_row - BENCH_AFTER
        bench = 0.0
        if counted and strikes >= 0:
            bench = min(self.max_bench_s, self.base_bench_s * 2 ** min(strikes, 30))  # a day-long outage must not overflow
        if pause_s:
            bench = max(bench, pause_s)
        if bench <= 0:
            return
        was_benched = endpoint.benched(self.clock())
        endpoint.benched_until = max(endpoint.benched_until, self.clock() + bench)
        self._watch_health(endpoint)
        if was_benched or strikes < 0 or self.on_health is None:
            return  # a Retry-After alone is in the retry's own log line
        others = "others take its requests" if self.healthy_other_than(endpoint) else "no other endpoint: requests wait"
        self.on_health(
            "warning", f"{endpoint.config.label}: benched {bench:.1f}s after {endpoint.failures_in_a_row} failures ({reason}); {others}"
        )

    def _watch_health(self, endpoint: EndpointState) -> None:
        """Ask a benched endpoint's /health until the bench ends, if its server has one."""
        running = self._probes.get(endpoint)
        if endpoint.health_url is None or (running is not None and not running.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a caller without a loop: the bench's own end lets a request probe
        probe = self._probe_health(endpoint, endpoint.health_url)
        self._probes[endpoint] = loop.create_task(probe, name=f"health of {endpoint.config.label}")

    async def _probe_health(self, endpoint: EndpointState, url: str) -> None:
        went_down = False
        async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as session:
            while endpoint.benched(self.clock()):
                up = await _answers(session, url)
                if up and went_down:
                    self._reinstate(endpoint)
                    return
                went_down = went_down or not up
                await asyncio.sleep(self.health_probe_s)

    def _reinstate(self, endpoint: EndpointState) -> None:
        """Back in rotation in full, not on probation: one request at a time to a vLLM that has just
        restarted would be as slow as that request's whole reply."""
        endpoint.failures_in_a_row = 0
        endpoint.benched_until = 0.0
        self._room.set()
        if self.on_health is not None:
            self.on_health("info", f"{endpoint.config.label}: its server answers /health again; back in rotation")

    async def close(self) -> None:
        """Stop asking benched endpoints' /health (the run is over)."""
        probes = [task for task in self._probes.values() if not task.done()]
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._probes.clear()

    def stats(self, *, ended: bool = False) -> list[EndpointStats]:
        """Each endpoint's numbers; ``ended``: the run is over, so nothing is flowing any more."""
        now = self.clock()
        events = []
        for ep in self.endpoints:
            lat = sorted(ep.latencies)
            req_s, tok_s = ep.meter.rates() if not ended else (0.0, 0.0)
            events.append(
                EndpointStats(
                    url=ep.config.label,
                    in_flight=ep.in_flight,
                    requests=ep.requests,
                    errors=ep.errors,
                    req_per_s=round(req_s, 3),
                    tok_per_s=round(tok_s, 1),
                    latency_p50_s=round(lat[len(lat) // 2], 4) if lat else None,
                    latency_p95_s=round(lat[min(len(lat) - 1, int(len(lat) * 0.95))], 4) if lat else None,
                    benched_s=round(ep.benched_until - now, 1) if ep.benched(now) else None,
                )
            )
        return events

    def healthy_other_than(self, endpoint: EndpointState) -> bool:
        now = self.clock()
        return any(ep is not endpoint and not ep.benched(now) and ep.failures_in_a_row < BENCH_AFTER for ep in self.endpoints)


async def _answers(session: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
        async with session.get(url) as response:
            return response.status == 200
    return False
