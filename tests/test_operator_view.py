"""What an operator reads off the console is true (issue 20): the demo's own server is named as
ours, not as vLLM, and counts the requests it holds; the first host CPU reading is a reading."""

from __future__ import annotations

import asyncio

from pipeline.engine.telemetry import StaticGpuReader, server_metrics, telemetry_loop
from pipeline.protocol.events import GpuStats, HostStats
from pipeline.servers.metrics import parse_prometheus


def test_our_model_server_is_not_named_vllm():
    ours = parse_prometheus("vllm:num_requests_running 2\nvllm:generation_tokens_total 10\neagleops_server:info 1\n")
    assert server_metrics("u", ours, None, 0.0)[0].software == "eagleops"
    real = parse_prometheus("vllm:num_requests_running 2\nvllm:generation_tokens_total 10\n")
    assert server_metrics("u", real, None, 0.0)[0].software == "vllm"


async def test_the_model_server_counts_every_request_it_holds(monkeypatch):
    """32 in flight, none being generated this instant (a batch being collected): 32 wait, not 0."""
    from aiohttp.test_utils import make_mocked_request

    from pipeline.servers.model import ModelServer

    server = ModelServer.__new__(ModelServer)  # its counters and /metrics, without a model
    server.running, server.accepted = 0, 32
    server.counters = {"prompt": 0, "generation": 0, "success": 0, "aborted": 0}
    server.jobs = None
    response = await server.metrics(make_mocked_request("GET", "/metrics"))
    values = parse_prometheus(response.text)
    assert values["vllm:num_requests_waiting"] == 32 and values["vllm:num_requests_running"] == 0
    server.running = 8
    values = parse_prometheus((await server.metrics(make_mocked_request("GET", "/metrics"))).text)
    assert values["vllm:num_requests_waiting"] == 24


async def test_the_first_host_cpu_reading_is_not_the_zero_of_a_first_call(monkeypatch):
    import psutil

    calls = []

    def cpu_percent(interval=None):  # psutil's: the share since the last call, 0.0 on the first
        calls.append(interval)
        return 0.0 if len(calls) == 1 else 37.0

    monkeypatch.setattr(psutil, "cpu_percent", cpu_percent)
    readings: list[HostStats] = []

    def on_reading(key, event):
        if isinstance(event, HostStats):
            readings.append(event)

    task = asyncio.create_task(telemetry_loop(None, StaticGpuReader(GpuStats(gpus=(), error="no NVIDIA GPU")), list, on_reading, lambda *a: None, 0.05))  # type: ignore[arg-type]
    while not readings:
        await asyncio.sleep(0.01)
    task.cancel()
    assert readings[0].cpu_percent == 37.0
