"""A pipeline's teardown: each part's stop runs in the fixed stop order whatever the order of
registration, is made only when its turn comes, and a set-up that fails half-way stops exactly
what it had started (no Ray: the trainer's start is what fails)."""

from __future__ import annotations

import asyncio

import pytest

from rlix.config.models import PipelineConfig
from rlix.pipeline.hooks import NoOpHooks
from rlix.pipeline.parts import STOP_ORDER, Teardown
from rlix.pipeline.runner import PipelineRunner


def test_stops_run_in_the_fixed_order_each_made_when_its_turn_comes():
    done: list[str] = []

    def stop(name: str):
        async def step() -> None:
            done.append(name)
        return lambda: (done.append(f"made {name}"), step())[1]

    teardown = Teardown(STOP_ORDER)
    for name in ("trainer", "data plane", "leave", "experiment log", "shards"):  # as a set-up interleaves
        teardown.add(name, stop(name))
    teardown.add("router", lambda: None)  # nothing left to do by its turn: no step, no timing

    async def main() -> list[str]:
        names = []
        for name, step in teardown.steps():
            names.append(name)
            await step
        return names
    assert asyncio.run(main()) == ["leave", "data plane", "shards", "trainer", "experiment log"]
    assert done == [x for name in ("leave", "data plane", "shards", "trainer", "experiment log")
                    for x in (f"made {name}", name)]


def test_a_dropped_stop_does_not_run_and_a_part_has_one_place():
    teardown = Teardown(STOP_ORDER)
    teardown.add("leave", lambda: None)
    teardown.drop("leave")
    assert list(teardown.steps()) == []
    with pytest.raises(ValueError, match="no place"):
        teardown.add("the moon", lambda: None)
    teardown.add("trainer", lambda: None)
    with pytest.raises(ValueError, match="already"):
        teardown.add("trainer", lambda: None)


class _Hooks(NoOpHooks):
    def __init__(self) -> None:
        super().__init__()
        self.left = 0

    async def leave(self) -> None:
        self.left += 1


def test_a_set_up_that_fails_half_way_stops_what_it_started(tmp_path, tiny_model_dir, monkeypatch):
    cfg = PipelineConfig(name="p", model=str(tiny_model_dir))
    hooks = _Hooks()
    runner = PipelineRunner(cfg, hooks, run_dir=tmp_path, api_key="k")

    async def no_trainer(path: str, gpus: list[int]):
        await asyncio.sleep(0.2)  # the engines' side has started by then
        raise RuntimeError("the trainer did not start")
    monkeypatch.setattr(runner, "_start_trainer", no_trainer)

    async def main() -> dict[str, float]:
        with pytest.raises(RuntimeError, match="did not start"):
            await runner.setup()
        assert runner.parts is None and runner.started.fleet is not None
        assert runner.progress()["processes"]["shards"] == {}  # reports read what was made
        with pytest.raises(RuntimeError, match="no summary"):
            runner.summary()
        took = await runner.shutdown()
        assert await runner.resize_inference([], {0: [0]}) == {"skipped": "pipeline is shutting down"}
        return took
    took = asyncio.run(main())
    # the engines' side (router, its thread, the fleet) and the scheduler; no trainer, weight
    # path, collector or experiment log: those never started
    assert [k for k in took] == ["leave", "router", "data plane", "shards"], took
    assert hooks.left == 1
