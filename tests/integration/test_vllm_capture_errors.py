"""extract's vLLM backend without a vLLM: a worker's exception reaches eagleops in the worker's
own words (vLLM 0.32's collective_rpc answers a bare HTTP 500 with the text in its body), a
multimodal target's decoder is found through its language model and captured as vLLM serves
it (``--language-model-only``), and the run file's remote-code opt-in reaches vLLM."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.servers import vllm_capture
from eagleops.pipeline.servers.vllm import VllmLaunch, collective_rpc, launch_for, vllm_said
from eagleops.pipeline.training.extract.served import capture_launch
from eagleops.pipeline.training.modeling.target import is_multimodal, raw_config

from .test_real_targets import _config as zoo_run_config

# vLLM 0.32's body for a worker's exception in a collective_rpc (multiprocess executor):
# engine/core.py wraps the executor's RuntimeError, the API server's handler sends it as a 500
WORKER_SAID = "vLLM fed KimiK25ForConditionalGeneration embeddings (input_ids=None), not token ids"
RPC_FAILED = {
    "error": {
        "message": f"Call to collective_rpc method failed: Worker failed with error '{WORKER_SAID}', "
        "please check the stack trace above for the root cause",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (json.dumps(RPC_FAILED).encode(), f"a worker raised: {WORKER_SAID}"),
        # the in-process executor (VLLM_ENABLE_V1_MULTIPROCESSING=0) gives the exception alone
        (json.dumps({"error": {"message": "Call to collective_rpc method failed: boom"}}).encode(), "boom"),
        # an engine that died in a forward
        (
            json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause."}}).encode(),
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        ),
        (b"Internal Server Error", "Internal Server Error"),
    ],
)
def test_what_vllm_said_is_read_from_its_error_body(body, said):
    assert vllm_said(body) == said


@pytest.fixture
def failing_vllm() -> Iterator[str]:
    """A server that answers every POST as vLLM answers a collective_rpc whose worker raised."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps(RPC_FAILED).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_workers_exception_reaches_eagleops_in_its_own_words(failing_vllm, tmp_path):
    log_path = tmp_path / "servers" / "vllm-extract.log"
    with pytest.raises(RunError) as failed:
        collective_rpc(failing_vllm, log_path, "eagleops_capture_dump", "x")
    said = str(failed.value)
    assert WORKER_SAID in said and "HTTP 500" in said and "eagleops_capture_dump" in said
    assert str(log_path) in said
    assert "HTTP Error 500" not in said  # urllib's words alone say nothing


def test_a_dead_server_names_its_log(tmp_path):
    log_path = tmp_path / "vllm-extract.log"
    with pytest.raises(RunError, match="its log: .*vllm-extract.log"):
        collective_rpc("http://127.0.0.1:9", log_path, "eagleops_capture_start", "[1]")


# ---- the capture extension inside vLLM's worker, with vLLM's module tree mimicked -----------------


def _vllm_like_kimi():
    """vLLM's KimiK25ForConditionalGeneration as the extension sees it: the decoder at
    ``language_model.model`` (a DeepseekV2ForCausalLM's), no ``model`` attribute of its own, the
    language model named by ``get_language_model()`` (vLLM's multimodal interface)."""
    import torch

    class Layer(torch.nn.Module):
        def forward(self, hidden, residual):  # vLLM's decoder layers return (hidden, residual)
            residual = hidden if residual is None else hidden + residual
            return hidden * 2, residual

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(4))
            self.norm = torch.nn.Identity()

        def forward(self, input_ids, positions, inputs_embeds=None):
            hidden = inputs_embeds if input_ids is None else input_ids.float()[:, None].repeat(1, 3)
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual)
            return self.norm(hidden + residual)

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Decoder()

        def forward(self, input_ids, positions, inputs_embeds=None):
            return self.model(input_ids, positions, inputs_embeds)

    class KimiK25ForConditionalGeneration(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = LanguageModel()
            self.vision_tower = torch.nn.Identity()

        def get_language_model(self):
            return self.language_model

        def forward(self, input_ids, positions, inputs_embeds=None):
            return self.language_model(input_ids, positions, inputs_embeds)

    class Worker(vllm_capture.HiddenStateCapture):
        model = KimiK25ForConditionalGeneration()

        def get_model(self):
            return self.model

    return Worker()


def test_a_multimodal_wrappers_decoder_is_found_through_its_language_model(tmp_path):
    import torch

    worker = _vllm_like_kimi()
    assert json.loads(worker.eagleops_capture_start("[1, 2]")) == ["1", "2", "final"]
    worker.model(input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]))
    worker.eagleops_capture_dump(str(tmp_path / "d"))
    captured = vllm_capture.read_dump(tmp_path / "d")
    assert captured[vllm_capture.TOKENS].tolist() == [5, 6] and captured[vllm_capture.POSITIONS].tolist() == [0, 1]
    # layer 0 gives (2x, x), layer 1 (4x, 3x): the residual stream after layer 1 is their sum
    assert captured["1"][:, 0].tolist() == [5.0 * 7, 6.0 * 7]
    worker.eagleops_capture_stop()


def test_a_forward_fed_embeddings_is_refused_at_the_dump_not_in_the_forward(tmp_path):
    """A forward vLLM feeds embeddings (a multimodal model served whole) runs on: the next dump
    raises, which collective_rpc hands back to eagleops, and no rows are written."""
    import torch

    worker = _vllm_like_kimi()
    worker.eagleops_capture_start("[1]")
    worker.model(input_ids=None, positions=torch.tensor([0, 1]), inputs_embeds=torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="KimiK25ForConditionalGeneration embeddings.*--language-model-only"):
        worker.eagleops_capture_dump(str(tmp_path / "d"))
    assert not list(tmp_path.iterdir())
    worker.model(input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]))  # the fault is said once
    assert json.loads(worker.eagleops_capture_dump(str(tmp_path / "d")))["input_ids"] == [2]
    worker.eagleops_capture_stop()


# ---- how the capture server is started -------------------------------------------------------------


def test_a_multimodal_target_is_captured_as_its_language_model_only(zoo_files, tmp_path):
    kimi, qwen = zoo_files("kimi-k2.5"), zoo_files("qwen3-8b")
    assert is_multimodal(raw_config(kimi)) and not is_multimodal(raw_config(qwen))
    for model, flagged in ((kimi, True), (qwen, False)):
        launch = capture_launch(VllmLaunch(sys.executable, model), tmp_path / "ext", 100, multimodal=is_multimodal(raw_config(model)))
        assert ("--language-model-only" in launch.argv(8000)) is flagged


def test_a_wrapper_of_a_text_config_without_a_vision_config_is_multimodal_too(tmp_path):
    config = {"architectures": ["SomeAudioForConditionalGeneration"], "audio_config": {}, "text_config": {"hidden_size": 8}}
    assert is_multimodal(config)
    assert not is_multimodal({"architectures": ["T5ForConditionalGeneration"], "d_model": 8})


@pytest.mark.parametrize("trusted", [True, False])
def test_the_remote_code_opt_in_reaches_vllm(zoo_files, tmp_path, trusted):
    """Kimi-K2.5's tokenizer is its own code: without --trust-remote-code vLLM 0.32 tokenizes
    its text with a generic tokenizer of the same tiktoken file, and says no more than a warning."""
    serve = {"serve": {"python": sys.executable}}
    config = zoo_run_config(tmp_path, zoo_files("kimi-k2.5"), serve, **({"trust_remote_code": True} if trusted else {}))
    assert ("--trust-remote-code" in launch_for(config).argv(8000)) is trusted


def test_the_capture_extension_file_stands_alone():
    """vLLM imports the copied file by itself: it must not import eagleops."""
    source = Path(vllm_capture.__file__).read_text()
    assert "from pipeline" not in source and "import pipeline" not in source
