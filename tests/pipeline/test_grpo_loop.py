"""GrpoLoop against fakes (a TrainerGroup's async methods): a step the trainer took is recorded once, even when it is cut short."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rlix.config.models import PipelineConfig
from rlix.pipeline.rollout.types import NO_DEMAND
from rlix.pipeline.async_grpo import GrpoLoop
from rlix.pipeline.rollout.types import Group, Trajectory


class FakeTrainer:
    def __init__(self) -> None:
        self.step = 0
        self.started = asyncio.Event()
        self.finish = asyncio.Event()

    async def reload(self, *args):
        return SimpleNamespace(reserved=0, device_free=None, as_dict=lambda: {})

    offload = reload

    async def reload_bytes(self):
        return 0

    async def train_step(self, samples):
        self.started.set()
        await self.finish.wait()  # the remote step runs on, whatever the caller does
        self.step += 1
        return {"loss": 0.5}

    async def publish(self, version, audit, on_device=False):
        return SimpleNamespace(audit_s=0.0)


class FakeBuffer:
    def take(self, n, version, max_age):
        trajectories = [Trajectory(f"t{i}", "g", [1, 2], [3, 4], [-0.1, -0.2], float(i), version) for i in range(2)]
        return [Group("g", "prompt", trajectories)]


class FakeHooks:
    async def before_training(self, version):
        return [0]

    async def after_training(self, version, demand=None):
        return None


class FakeCollector:
    def __init__(self) -> None:
        self.buffer = FakeBuffer()
        self.held = False
        self.version = 0

    async def wait_for(self, n):
        return None

    def take(self, n):
        return self.buffer.take(n, self.version, 1)

    def set_version(self, v, held=False):
        self.version, self.held = v, held

    def open_admission(self):
        self.held = False

    def demand_for_release(self):
        return NO_DEMAND


class FakeCoordinator:
    syncs_on_device = False

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.failure = None
        self.warm: set[int] = set()

    def announce(self, v):
        pass

    async def publish(self, v):
        pass


def make_loop(rows: list) -> tuple[GrpoLoop, FakeTrainer]:
    trainer = FakeTrainer()
    loop = GrpoLoop(PipelineConfig(name="p", steps=3), trainer=trainer, weights=trainer, coordinator=FakeCoordinator(),
                    collector=FakeCollector(), buffer=FakeBuffer(), hooks=FakeHooks(),
                    on_step=rows.append)
    return loop, trainer


def test_a_step_cancelled_while_the_trainer_takes_it_is_recorded_once_the_trainer_finishes() -> None:
    """Ctrl-C lands while train_step is in flight: the trainer finishes the step anyway (and a
    checkpoint on the way out saves it), so the loop records it and says it holds that step."""
    async def scenario() -> None:
        rows: list = []
        loop, trainer = make_loop(rows)
        run = asyncio.ensure_future(loop.run())
        await trainer.started.wait()
        run.cancel()
        await asyncio.sleep(0.05)
        assert not run.done()  # waiting for the trainer's step, not abandoning it
        trainer.finish.set()
        try:
            await run
        except asyncio.CancelledError:
            pass
        assert trainer.step == 1 and loop.step == 1
        assert [r.step for r in rows] == [1] and rows[0].loss == 0.5 and rows[0].sync_s == 0.0

    asyncio.run(scenario())


def test_finished_steps_are_recorded_in_order_with_their_phases() -> None:
    async def scenario() -> None:
        rows: list = []
        loop, trainer = make_loop(rows)
        trainer.finish.set()
        await loop.run()
        assert [r.step for r in rows] == [1, 2, 3] and loop.step == trainer.step == 3
        assert all(r.step_s >= r.train_s >= 0 and r.reward == 0.5 for r in rows)

    asyncio.run(scenario())


def test_shards_beside_the_trainer_are_synced_from_its_gpu_before_the_offload_and_cooled_after() -> None:
    """With device syncs: publish keeps a GPU copy, the shards beside the trainer are synced from
    it before the offload (its time is the step's device_sync_s), and after the release the ones
    the control plane did not place again are cooled."""
    calls: list = []

    class Trainer(FakeTrainer):
        device_ranks = [0, 1]

        async def publish(self, version, audit, on_device=False):
            calls.append(("publish", version, on_device))
            return SimpleNamespace(audit_s=0.0)

        async def offload(self, *args):
            calls.append(("offload",))
            return SimpleNamespace(reserved=0, device_free=None, as_dict=lambda: {})

    class Coordinator(FakeCoordinator):
        syncs_on_device = True

        async def sync_beside_trainer(self, version, gpus, device_ranks):
            calls.append(("beside", version, list(gpus), list(device_ranks)))
            await asyncio.sleep(0.05)
            self.warm = {0, 1}
            return [0, 1]

        async def cool(self, held):
            calls.append(("cool", held))
            self.warm = set()
            return [1]

    class Hooks(FakeHooks):
        async def before_training(self, version):
            return [2, 5]

        async def after_training(self, version, demand=None):
            calls.append(("release",))

        async def shard_ranks(self):
            return {0}

    async def scenario() -> None:
        rows: list = []
        trainer = Trainer()
        trainer.finish.set()
        loop = GrpoLoop(PipelineConfig(name="p", steps=1), trainer=trainer, weights=trainer, coordinator=Coordinator(),
                        collector=FakeCollector(), buffer=FakeBuffer(), hooks=Hooks(), on_step=rows.append)
        await loop.run()
        assert calls == [("publish", 1, True), ("beside", 1, [2, 5], [0, 1]), ("offload",), ("release",),
                         ("cool", {0})]
        assert rows[0].device_sync_s >= 0.05 and rows[0].offload_s < rows[0].device_sync_s

    asyncio.run(scenario())
