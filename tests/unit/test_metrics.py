"""The /metrics text of vLLM and SGLang as the pipeline reads it: labels, HELP/TYPE lines,
histograms and counters' ``_created`` stamps, through prometheus_client's parser."""

from __future__ import annotations

import http.server
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eagleops.pipeline.engine.telemetry import server_metrics
from eagleops.pipeline.servers.metrics import parse_prometheus
from eagleops.pipeline.servers.vllm import read_metrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# vLLM V1 with data parallel 2: every series labelled by engine and model, histograms and
# counters' creation stamps as prometheus_client writes them
VLLM = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12060.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.5
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.25
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} 1200.0
vllm:generation_tokens_total{{engine="1",model_name="{MODEL}"}} 800.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{{engine="0",model_name="{MODEL}"}} 1.7549e+09
vllm:generation_tokens_created{{engine="1",model_name="{MODEL}"}} 1.7549e+09
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="{MODEL}"}} 100.0
vllm:spec_decode_num_drafts_total{{engine="1",model_name="{MODEL}"}} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{MODEL}"}} 250.0
vllm:spec_decode_num_accepted_tokens_total{{engine="1",model_name="{MODEL}"}} 150.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{MODEL}",position="0"}} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{MODEL}",position="1"}} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",model_name="{MODEL}",position="0"}} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",model_name="{MODEL}",position="1"}} 40.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",model_name="{MODEL}"}} 2.0
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 7.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{MODEL}"}} 7.0
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="{MODEL}"}} 12.5
"""

# SGLang with --enable-metrics: gauges labelled by model and rank, a latency histogram
SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.3
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 1000.5
sglang:gen_throughput{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 234.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
sglang:spec_accept_length{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 5000.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 9.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 1.5
sglang:time_to_first_token_seconds_count{model_name="m"} 9.0
"""


def test_vllm_counters_and_gauges_over_engines():
    values = parse_prometheus(VLLM)
    assert values["vllm:generation_tokens_total"] == 2000.0  # counters add over engines
    assert values["vllm:num_requests_running"] == 8.0
    assert values["vllm:kv_cache_usage_perc"] == 0.375  # a fraction is averaged, never past 1
    assert values["vllm:e2e_request_latency_seconds_count"] == 7.0
    assert values["vllm:e2e_request_latency_seconds_sum"] == 12.5
    assert not any(key.endswith(("_bucket", "_created")) for key in values)  # neither is an amount


def test_vllm_per_position_counts_kept_apart():
    values = parse_prometheus(VLLM, split_by="position")
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] == 140.0
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total[1]"] == 110.0
    assert values["vllm:spec_decode_num_drafts_total"] == 160.0  # unlabelled by position: one key
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" not in values


def test_one_model_of_several():
    """A server whose series carry two models: one picked, or both added up."""
    both = VLLM + "".join(line.replace(MODEL, "drafter-b") + "\n" for line in VLLM.splitlines() if line.startswith("vllm:"))
    assert parse_prometheus(both)["vllm:generation_tokens_total"] == 4000.0
    assert parse_prometheus(both, model=MODEL)["vllm:generation_tokens_total"] == 2000.0
    assert parse_prometheus(both, model="drafter-b")["vllm:num_requests_running"] == 8.0
    assert parse_prometheus(both, model="absent")["python_gc_objects_collected_total"] == 12060.0  # unlabelled: every model's


def test_what_prometheus_client_itself_writes():
    """vLLM and SGLang publish through prometheus_client: its own text, counters' _created included."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    tokens = Counter("vllm:generation_tokens", "Generation tokens.", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", labels, registry=registry)
    latency = Histogram("vllm:e2e_request_latency_seconds", "Latency.", labels, buckets=(0.1, 1.0), registry=registry)
    for engine, (count, used) in enumerate(((30, 0.2), (12, 0.6))):
        tokens.labels(str(engine), "m").inc(count)
        usage.labels(str(engine), "m").set(used)
        latency.labels(str(engine), "m").observe(0.5)
    values = parse_prometheus(generate_latest(registry).decode())
    assert values == {
        "vllm:generation_tokens_total": 42.0,
        "vllm:kv_cache_usage_perc": pytest.approx(0.4),
        "vllm:e2e_request_latency_seconds_count": 2.0,
        "vllm:e2e_request_latency_seconds_sum": 1.0,
    }


def test_sglang_through_the_console_shape():
    metrics, previous = server_metrics("u", parse_prometheus(SGLANG), None, 0.0)
    assert metrics.software == "sglang"
    assert (metrics.running, metrics.waiting, metrics.gen_tok_per_s) == (7.0, 2.0, 1234.5)
    assert metrics.kv_usage == pytest.approx(0.4) and metrics.accept_length == 2.5  # averaged over DP ranks
    assert previous is not None and previous.gen_total == 5000.0


def test_vllm_through_the_console_shape():
    first, previous = server_metrics("u", parse_prometheus(VLLM), None, 10.0)
    assert (first.software, first.running, first.waiting, first.kv_usage) == ("vllm", 8.0, 1.0, 0.375)
    assert first.accept_length == 1 + 400 / 160
    later = VLLM.replace("} 1200.0", "} 3200.0")
    second, _ = server_metrics("u", parse_prometheus(later), previous, 12.0)
    assert second.gen_tok_per_s == 1000.0


def test_text_that_is_not_prometheus_is_an_error():
    with pytest.raises(ValueError):
        parse_prometheus("<html><body>502 Bad Gateway</body></html>\n")
    assert parse_prometheus("") == {}


def test_read_metrics_over_http():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = VLLM.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        values = read_metrics(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total[1]"] == 110.0
    assert values["vllm:spec_decode_num_drafts_total"] == 160.0
    assert all(key.startswith("vllm:") for key in values)  # the process's own python_* series left out
