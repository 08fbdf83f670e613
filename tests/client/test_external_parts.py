"""The pipeline side of rlix.client without a run: the version hand-over to WeightPath
(ClientPublisher), the program's process (ProgramProcess) and the config's checks."""

from __future__ import annotations

import asyncio
import sys

import pytest
from pydantic import ValidationError

from rlix.config.models import PipelineConfig
from rlix.errors import ClientOrderError
from rlix.pipeline.external.program import ProgramProcess
from rlix.pipeline.external.publisher import ClientPublisher
from rlix.weights.api import PublishedVersion


def version(v: int) -> PublishedVersion:
    return PublishedVersion(version=v, num_buckets=1, bytes=8, seconds=0.01, versions=[v], refs=None)


def test_publish_waits_for_the_clients_build_and_returns_it():
    async def go() -> None:
        pub = ClientPublisher()
        pub.expect(3)
        publishing = asyncio.ensure_future(pub.publish(3))
        await asyncio.wait_for(pub.slot_free(3), 1)  # WeightPath asked: the client may build now
        assert not publishing.done()
        pub.deliver(version(3))
        assert (await asyncio.wait_for(publishing, 1)).version == 3
        with pytest.raises(ClientOrderError, match="not opened"):  # a version delivered twice
            pub.deliver(version(3))

    asyncio.run(go())


def test_a_version_not_opened_is_refused_on_both_sides():
    async def go() -> None:
        pub = ClientPublisher()
        with pytest.raises(ClientOrderError):
            await pub.publish(1)
        pub.expect(1)
        with pytest.raises(ClientOrderError):
            pub.deliver(version(2))

    asyncio.run(go())


def test_the_program_runs_under_its_guard_and_stop_ends_it(tmp_path):
    log = tmp_path / "program.log"
    prog = ProgramProcess(["python", "-c", "import os, sys, time; print(sys.executable, os.environ['X'], flush=True); "
                           "time.sleep(60)"], log_path=log, extra_env={"X": "from-rlix"}, cwd=str(tmp_path))
    prog.start()
    try:
        for _ in range(100):
            if "from-rlix" in log.read_text():
                break
            asyncio.run(asyncio.sleep(0.05))
        assert f"{sys.executable} from-rlix" in log.read_text()  # `python`: rlix's interpreter
        assert prog.poll() is None and prog.pid() is not None
        assert oct(log.stat().st_mode & 0o777) == "0o600"
    finally:
        code = prog.stop(grace_s=5)
    assert code is not None and prog.poll() is not None


def test_an_external_pipeline_takes_no_agent_environment():
    ok = PipelineConfig.model_validate({"name": "x", "external": {"command": ["python", "loop.py"]}})
    assert ok.external is not None and ok.external.after_training_timeout_s == 600
    with pytest.raises(ValidationError, match="env: is for rlix's own loop"):
        PipelineConfig.model_validate({"name": "x", "external": {"command": ["python", "loop.py"]},
                                       "env": {"name": "repeat", "resources": "rlix.agents.envs.repeat:RepeatResources",
                                               "agent": "rlix.agents.tool_agent:ToolAgent"}})
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate({"name": "x", "external": {"command": []}})


def test_rlix_check_names_a_program_that_cannot_start(tmp_path):
    from rlix.config.models import RlixConfig
    from rlix.config.preflight import problems

    (tmp_path / "loop.py").write_text("print('hi')\n")

    def found(external: dict) -> list[str]:
        cfg = RlixConfig.model_validate({"run_dir": str(tmp_path / "run"),
                                         "pipelines": [{"name": "x", "external": external}]})
        return [p for p in problems(cfg) if ".external." in p]

    assert found({"command": ["python", "loop.py"], "cwd": str(tmp_path)}) == []
    assert found({"command": ["python", "-u", "nope.py"], "cwd": str(tmp_path)}) == [
        f"pipelines[0] (x).external.command: no Python script 'nope.py' (from {tmp_path})"]
    assert found({"command": ["no-such-program-here"]}) == [
        "pipelines[0] (x).external.command: 'no-such-program-here' is not on PATH"]
    assert found({"command": ["./loop.py"], "cwd": str(tmp_path)}) == [
        "pipelines[0] (x).external.command: './loop.py' is not an executable file"]
    assert found({"command": ["python", "loop.py"], "cwd": str(tmp_path / "gone")}) == [
        f"pipelines[0] (x).external.cwd: {str(tmp_path / 'gone')!r} is not a directory"]
