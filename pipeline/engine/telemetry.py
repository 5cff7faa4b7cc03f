"""Machine and server telemetry, published by the engine as events so an attached console sees
the engine host's GPUs: NVML behind a small reader interface (every field may be N/A, a missing
driver is a state, never a crash), host CPU/RAM via psutil, and Prometheus ``/metrics`` of SGLang
and vLLM servers.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from eagleops.pipeline.config import EndpointConfig
from eagleops.pipeline.protocol.events import Event, GpuStats, HostStats, ServerMetrics
from eagleops.pipeline.servers.metrics import parse_prometheus

__all__ = [
    "telemetry_loop",
    "GpuReader",
    "NvmlReader",
    "StaticGpuReader",
    "SyntheticGpuReader",
    "gpu_reader_from_env",
    "parse_prometheus",
    "read_host",
    "scrape_metrics",
    "server_metrics",
]


class GpuReader(Protocol):
    def read(self) -> GpuStats:
        """Blocking: called through asyncio.to_thread."""


def _na(call, *args):
    """One NVML field, or None when this GPU/driver cannot say (NotSupported, NoPermission...)."""
    try:
        return call(*args)
    except Exception:
        return None


class NvmlReader:
    """Reads NVML with a TTL cache (NVML calls can take milliseconds each on busy nodes)."""

    def __init__(self, ttl_s: float = 1.0):
        self.ttl_s = ttl_s
        self._cached: GpuStats | None = None
        self._at = 0.0
        self._nvml = None
        self._error: str | None = None

    def _init(self):
        if self._nvml is None and self._error is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as exc:
                self._error = f"no NVIDIA GPU ({type(exc).__name__})"
        return self._nvml

    def read(self) -> GpuStats:
        now = time.monotonic()
        if self._cached is not None and now - self._at < self.ttl_s:
            return self._cached
        nvml = self._init()
        if nvml is None:
            stats = GpuStats(gpus=(), error=self._error or "no NVIDIA GPU")
        else:
            stats = self._sample(nvml)
        self._cached, self._at = stats, now
        return stats

    def _sample(self, nvml) -> GpuStats:
        count = _na(nvml.nvmlDeviceGetCount)
        if count is None:
            return GpuStats(gpus=(), error="NVML failed to count GPUs")
        gpus: list[tuple] = []
        for i in range(count):
            handle = _na(nvml.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                gpus.append((i, "GPU lost", None, None, None, None, None))
                continue
            name = _na(nvml.nvmlDeviceGetName, handle)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            util = _na(nvml.nvmlDeviceGetUtilizationRates, handle)
            mem = _na(nvml.nvmlDeviceGetMemoryInfo, handle)
            temp = _na(nvml.nvmlDeviceGetTemperature, handle, 0)
            power = _na(nvml.nvmlDeviceGetPowerUsage, handle)
            gpus.append(
                (
                    i,
                    name or "?",
                    float(util.gpu) if util is not None else None,
                    int(mem.used) if mem is not None else None,
                    int(mem.total) if mem is not None else None,
                    float(temp) if temp is not None else None,
                    power / 1000.0 if power is not None else None,
                )
            )
        return GpuStats(gpus=tuple(gpus), error=None if gpus else "no NVIDIA GPU")


class StaticGpuReader:
    """A reader that returns what it is given: for tests and snapshots."""

    def __init__(self, stats: GpuStats):
        self.stats = stats

    def read(self) -> GpuStats:
        return self.stats


class SyntheticGpuReader:
    """Plausible moving numbers for one GPU: for demos and benchmarks on machines without one
    (``EAGLEOPS_GPU_READER=synthetic``)."""

    def __init__(self, count: int = 1):
        self.count = count
        self._start = time.monotonic()

    def read(self) -> GpuStats:
        import math

        t = time.monotonic() - self._start
        gib = 2**30
        gpus = tuple(
            (
                i,
                "Synthetic H200",
                70 + 25 * math.sin(t / 7 + i),
                int((90 + 10 * math.sin(t / 30)) * gib),
                141 * gib,
                60 + 5 * math.sin(t / 50),
                500 + 100 * math.sin(t / 9),
            )
            for i in range(self.count)
        )
        return GpuStats(gpus=gpus)


def gpu_reader_from_env() -> GpuReader:
    if os.environ.get("EAGLEOPS_GPU_READER") == "synthetic":
        return SyntheticGpuReader()
    return NvmlReader()


def read_host() -> HostStats:
    import psutil

    mem = psutil.virtual_memory()
    return HostStats(cpu_percent=psutil.cpu_percent(interval=None), mem_used=int(mem.used), mem_total=int(mem.total))


@dataclass
class _Previous:
    at: float
    gen_total: float


def server_metrics(url: str, values: dict[str, float], previous: _Previous | None, now: float) -> tuple[ServerMetrics, _Previous | None]:
    """Read SGLang's or vLLM's names into one shape; vLLM's tok/s comes from counter deltas."""
    if any(k.startswith("sglang:") for k in values):
        gen_total = values.get("sglang:generation_tokens_total")
        return (
            ServerMetrics(
                url=url,
                software="sglang",
                running=values.get("sglang:num_running_reqs"),
                waiting=values.get("sglang:num_queue_reqs"),
                kv_usage=values.get("sglang:token_usage"),
                gen_tok_per_s=values.get("sglang:gen_throughput"),
                accept_length=values.get("sglang:spec_accept_length"),
            ),
            _Previous(now, gen_total) if gen_total is not None else None,
        )
    if any(k.startswith("vllm:") for k in values):
        # eagleops' own model server (the demo's) speaks vLLM's names and says it is not vLLM
        software = "eagleops" if "eagleops_server:info" in values else "vllm"
        gen_total = values.get("vllm:generation_tokens_total")
        rate = None
        if gen_total is not None and previous is not None and now > previous.at and gen_total >= previous.gen_total:
            rate = (gen_total - previous.gen_total) / (now - previous.at)
        drafts = values.get("vllm:spec_decode_num_drafts_total")
        accepted = values.get("vllm:spec_decode_num_accepted_tokens_total")
        return (
            ServerMetrics(
                url=url,
                software=software,
                running=values.get("vllm:num_requests_running"),
                waiting=values.get("vllm:num_requests_waiting"),
                kv_usage=values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc")),
                gen_tok_per_s=rate,
                accept_length=(1 + accepted / drafts) if drafts and accepted is not None else None,
            ),
            _Previous(now, gen_total) if gen_total is not None else None,
        )
    return ServerMetrics(url=url, software="none"), None


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """GET the server's /metrics (beside /v1); None when it has none (OpenRouter, SGLang without
    --enable-metrics)."""
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        async with session.get(f"{root}/metrics", timeout=aiohttp.ClientTimeout(total=3)) as response:
            if response.status != 200:
                return None
            return parse_prometheus(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):  # ValueError: not UTF-8, or not Prometheus text
        return None


async def telemetry_loop(
    session: aiohttp.ClientSession,
    gpu_reader: GpuReader,
    endpoints: Callable[[], list[EndpointConfig]],
    on_reading: Callable[[str, Event], None],
    log: Callable[[str, str], None],
    interval_s: float,
) -> None:
    """GPUs and host every tick; servers' /metrics every few ticks. Never on the event loop's
    critical path: NVML and psutil run in a thread, scrapes are plain async requests. Each
    reading goes to ``on_reading`` under a key that a newer reading of the same thing replaces."""
    previous: dict[str, _Previous | None] = {}
    tick = 0
    await asyncio.to_thread(read_host)  # psutil's CPU share is since the last call: the first one says 0%
    await asyncio.sleep(min(interval_s, 0.25))
    while True:
        try:
            gpu = await asyncio.to_thread(gpu_reader.read)
            host = await asyncio.to_thread(read_host)
        except Exception as exc:
            log("warning", f"telemetry: {type(exc).__name__}: {exc}")
        else:
            for event in (gpu, host):
                on_reading(event.kind, event)
        if tick % 3 == 0:
            for ep in endpoints():
                values = await scrape_metrics(session, ep.base_url)
                if values is None:
                    continue
                metrics, previous[ep.label] = server_metrics(ep.label, values, previous.get(ep.label), time.monotonic())
                on_reading(f"server:{ep.label}", metrics)
        tick += 1
        await asyncio.sleep(interval_s)
