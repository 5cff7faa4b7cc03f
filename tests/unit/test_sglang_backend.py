"""eval with backend sglang, against a loopback stand-in that answers in SGLang's shapes (no SGLang
runs on these machines): the launch line, token-id requests, per-request meta_info arithmetic."""

from __future__ import annotations

import json
import sys

from eagleops.pipeline.config import parse_run
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.eval.served import evaluate_sglang

FAKE = """
import json, sys
from aiohttp import web
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
draft = int(argv[argv.index("--speculative-num-draft-tokens") + 1]) if "--speculative-algorithm" in argv else 0
open(sys.argv[0] + f".argv.{'spec' if draft else 'plain'}", "w").write(json.dumps(argv))

async def generate(request):
    body = await request.json()
    n = body["sampling_params"]["max_new_tokens"]
    ids = [(body["input_ids"][-1] + i) % 50 for i in range(n)]   # greedy: the same either way
    meta = {"completion_tokens": n}
    if draft:
        meta["spec_verify_ct"] = -(-n // 3)   # 3 tokens per verify step
    return web.json_response({"output_ids": ids, "meta_info": meta})

app = web.Application()
app.router.add_get("/health", lambda r: web.Response(text="ok"))
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


def test_sglang_backend_launches_eagle3_and_reads_its_meta_info(tmp_path):
    server = tmp_path / "fake_sglang.py"
    server.write_text(FAKE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {server} "$@"\n')  # drops "-m sglang.launch_server"
    python.chmod(0o755)
    (tmp_path / "data.jsonl").write_text("")
    config = parse_run(
        {
            "output_dir": str(tmp_path / "out"),
            "datasets": [{"name": "A", "path": "data.jsonl", "token_budget": 1}],
            "target": {"model": str(tmp_path)},
            "serve": {"python": str(python), "tensor_parallel_size": 2, "startup_timeout_s": 60},
            "eval": {"backend": "sglang", "draft_tokens": 4, "max_new_tokens": 12},
        },
        base_dir=tmp_path,
    )
    prompts = [[1, 2, 3], [7, 8]]
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    [result] = evaluate_sglang(
        config, StageContext("eval"), [("held-out", 2, lambda decode: [decode(p) for p in prompts])], tmp_path / "drafter"
    )
    assert result.backend == "sglang" and result.greedy_mismatches == 0 and result.benchmark == "held-out"
    assert result.verify_steps == 8 and result.acceptance_length == 3.0  # 24 tokens / 8 steps
    spec = json.loads((tmp_path / "fake_sglang.py.argv.spec").read_text())
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert spec[spec.index("--speculative-draft-model-path") + 1] == str(tmp_path / "drafter")
    assert spec[spec.index("--speculative-num-steps") + 1] == "4" and spec[spec.index("--speculative-num-draft-tokens") + 1] == "5"
    assert spec[spec.index("--tp-size") + 1] == "2"
    assert "--speculative-algorithm" not in json.loads((tmp_path / "fake_sglang.py.argv.plain").read_text())


def test_sglang_serves_a_dflash_drafter_as_one_block(tmp_path):
    """SGLang's DFLASH algorithm counts the block, verified token included (dflash_utils.py)."""
    from eagleops.pipeline.servers.sglang import SglangLaunch

    argv = SglangLaunch(python="py", model=tmp_path, draft=tmp_path / "d", draft_tokens=15, block=True).argv(1)
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "16" and "--speculative-num-steps" not in argv
