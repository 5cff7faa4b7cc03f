"""One stage contract: the stages listed once and read by everything that names them, one
failure policy and one redactor in the host, for generate as for every compute stage."""

from __future__ import annotations

import asyncio

import pytest

from eagleops.pipeline.engine import Engine
from eagleops.pipeline.protocol.events import LogEvent, StageState, StageStatus
from eagleops.pipeline.stages import COMPUTE_STAGES, STAGE_NAMES, STAGES, stage
from tests.conftest import make_config, write_jsonl

SECRET = "sk-proj-9f8e7d6c5b4a3210-LEAK"


def test_every_consumer_reads_the_one_stage_list():
    from eagleops.cli import _parser
    from eagleops.pipeline.training.stages import stage_function

    assert STAGE_NAMES[0] == "generate" and COMPUTE_STAGES == STAGE_NAMES[1:]
    commands = set(_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert set(STAGE_NAMES) <= commands
    for name in COMPUTE_STAGES:  # each entry names a real function, imported only when asked
        assert callable(stage_function(name))
    with pytest.raises(KeyError, match="the stages are generate, prepare"):
        stage("distill")
    assert [s.name for s in STAGES if not s.needs_target] == ["generate"]


def _events(engine: Engine) -> list:
    seen: list = []
    publish = engine.bus.publish
    engine.bus.publish = lambda event: (seen.append(event), publish(event))[1]  # type: ignore[method-assign]
    return seen


async def test_a_compute_stages_log_lines_and_failure_pass_the_one_redactor(tmp_path, monkeypatch):
    from eagleops.pipeline.training import stages

    monkeypatch.setenv("EAGLEOPS_TEST_KEY", SECRET)

    def leaky(config, ctx):
        ctx.log("info", f"prepare: using key {SECRET}")
        raise RuntimeError(f"could not authenticate with {SECRET}")

    monkeypatch.setattr(stages, "stage_function", lambda name: leaky)
    config = make_config(
        tmp_path, "", [{"name": "A", "path": str(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])), "token_budget": 1}],
        endpoints=[{"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "EAGLEOPS_TEST_KEY"}],
        stages=["prepare"], target={"model": str(tmp_path)},
    )  # fmt: skip
    engine = Engine(config)
    seen = _events(engine)
    summary = await engine.run()
    assert summary.stages["prepare"] == StageStatus.FAILED and summary.exit_code == 1
    words = [e.message for e in seen if isinstance(e, LogEvent)] + [e.detail for e in seen if isinstance(e, StageState)]
    assert any("using key ***" in w for w in words) and any("could not authenticate with ***" in w for w in words)
    assert not any(SECRET in w for w in words)


async def test_generate_fails_as_every_stage_fails_instead_of_escaping_the_engine(tmp_path, monkeypatch):
    from eagleops.pipeline.generate.stage import GenerateStage

    monkeypatch.setenv("EAGLEOPS_TEST_KEY", SECRET)

    async def broken(self):
        raise ValueError(f"a bug, holding {SECRET}")

    monkeypatch.setattr(GenerateStage, "run", broken)
    config = make_config(
        tmp_path, "", [{"name": "A", "path": str(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])), "token_budget": 1}],
        endpoints=[{"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "EAGLEOPS_TEST_KEY"}],
    )  # fmt: skip
    engine = Engine(config)
    seen = _events(engine)
    summary = await engine.run()  # returns a summary: the failure is the stage's, not the engine's
    assert summary.stages["generate"] == StageStatus.FAILED and summary.exit_code == 1
    failed = [e for e in seen if isinstance(e, StageState) and e.status == StageStatus.FAILED]
    assert failed and failed[-1].detail == "a bug, holding ***"
    assert any(isinstance(e, LogEvent) and e.message == "generate: ValueError: a bug, holding ***" for e in seen)


def test_a_command_says_whether_it_is_for_the_run_a_stage_or_a_dataset():
    from eagleops.pipeline.protocol.events import Kill, Pause, SetBudget, command_from_json

    assert Pause().addressed == "the run" and Pause("B1").addressed == "dataset B1" and Pause(stage="train").addressed == "stage train"
    assert command_from_json(Pause(stage="train").to_json()) == Pause(stage="train")
    assert "stage" not in Pause("B1").to_json()  # a dataset's command reads as it always has
    assert SetBudget("B1", 5000).tokens == 5000
    with pytest.raises(ValueError, match="a dataset or a stage, not both"):
        command_from_json({"cmd": "kill", "dataset": "B1", "stage": "train"})
    with pytest.raises(ValueError, match="budgets are a dataset's"):
        command_from_json({"cmd": "budget", "stage": "train", "tokens": "5M"})
    assert command_from_json({"cmd": "kill"}) == Kill()


async def test_the_engine_routes_a_command_to_what_it_names(tmp_path, fault_server):
    from eagleops.pipeline.protocol.events import DatasetState, Pause, Resume
    from tests.integration.test_generate import prompts, wait_for

    source = write_jsonl(tmp_path / "a.jsonl", prompts(400, "[[tokens:5]] [[delay:0.05]]"))
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=2)
    engine = Engine(config)
    run = asyncio.create_task(engine.run())
    await wait_for(lambda: "A" in engine.generate.runners and engine.generate.runners["A"].store.accepted.samples >= 2)
    ack = await engine.execute(Pause("prepare"))  # a stage's name where a dataset's goes: not guessed
    assert not ack.ok and "eagleops pause --stage prepare" in ack.message
    assert not (await engine.execute(Pause(stage="distill"))).ok
    assert "not running" in (await engine.execute(Pause(stage="train"))).message
    assert (await engine.execute(Pause(stage="generate"))).ok  # generate's: every dataset
    await wait_for(lambda: engine.generate.runners["A"].state == DatasetState.PAUSED)
    assert (await engine.execute(Resume(stage="generate"))).ok
    engine.kill()
    assert (await run).killed
