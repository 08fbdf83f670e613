"""TrainerGroup: data-parallel trainer ranks, each its own TrainerActor, through a local Ray.

Two gloo ranks with half the batch each end up with identical weights, close to one rank's
with the whole batch; a rank killed by its PID fails the next step at once, naming the rank;
a batch smaller than the group is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlix.config.models import TrainConfig
from rlix.errors import TrainerDiedError, TrainingError
from rlix.training.ranks import TrainerGroup, split_batch
from rlix.training.trainer import PolicyTrainer
from trainer_helpers import weights_close

LR = 1e-3
#: every rank alike: one torch thread each (several processes on a 2-core host)
KWARGS = {"seed": 3, "cpu_threads": 1}


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def group_ray():
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def pair(group_ray, tiny_model_dir):
    """A 2-rank group, each rank placed on a (logical) GPU of its own: placement is rank_options'."""
    group = TrainerGroup.start(str(tiny_model_dir), TrainConfig(lr=LR, micro_batch_size=2),
                               [{"max_concurrency": 2, "num_gpus": 1}] * 2, step_timeout_s=30, **KWARGS)
    try:
        yield group
    finally:
        run(group.close())


@pytest.fixture
def batch(tiny_model_dir, samples_factory):
    """8 samples whose behaviour logprobs are the initial policy's plus noise (ratios near 1)."""
    return samples_factory(8, seed=70, trainer=PolicyTrainer(str(tiny_model_dir)))


def test_split_is_contiguous_and_balanced(samples_factory):
    samples = samples_factory(8, seed=1)
    shares = split_batch(samples, 3)
    assert [len(s) for s in shares] == [3, 3, 2]
    assert [x for s in shares for x in s] == samples


def test_two_ranks_match_one_rank(pair, group_ray, tiny_model_dir, batch, tmp_path):
    single = TrainerGroup.start(str(tiny_model_dir), TrainConfig(lr=LR, micro_batch_size=2),
                                [{"max_concurrency": 2}], **KWARGS)

    async def scenario():  # type: ignore[no-untyped-def]
        pids = await pair.pids()
        assert len(set(pids)) == 2 and await pair.pid() == pids[0]
        assert sorted(await pair.visible_devices()) == ["0", "1"]  # each rank its own GPU
        assert len(await pair.node_ids()) == 2
        await pair.ping()
        await pair.offload()  # the hand-off verbs reach every rank (a no-op measurement on CPU)
        assert (await pair.reload(5.0, ["gpu-a", "gpu-b"])).device == "cpu"
        got, want = await asyncio.gather(pair.train_step(batch), single.train_step(batch))
        published = await pair.publish(1, audit=True)
        assert published.version == 1 and published.versions == [1]
        # rank 1 holds no cache of its own in the group; audit it directly to compare exactly
        await pair.ranks[1].publish.remote(1, True)
        rank1 = await pair.ranks[1].weight_checksums.remote(1)
        assert await pair.weight_checksums(1) == rank1  # bit-identical ranks
        assert await pair.save_checkpoint(str(tmp_path / "pair")) == 1
        assert await single.save_checkpoint(str(tmp_path / "single")) == 1
        assert await pair.load_checkpoint(str(tmp_path / "pair")) == 1  # every rank agrees
        return got, want

    try:
        got, want = run(scenario())
    finally:
        run(single.close())
    assert got["num_samples"] == want["num_samples"] == 8
    # the pair's step made its own process group and destroyed it; one rank needs none
    assert got["ranks"] == 2 and got["group_destroyed"] == 1.0 and got["group_setup_s"] > 0
    assert "ranks" not in want
    assert got["num_tokens"] == want["num_tokens"]
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # the 2-rank step applies the 1-rank step's update up to float reduction order
    assert weights_close(weights(tmp_path / "pair"), weights(tmp_path / "single"), lr=LR, steps=1)


def test_batch_smaller_than_the_group_is_refused(pair, batch):
    with pytest.raises(TrainingError, match="1 samples cannot be split over 2"):
        run(pair.train_step(batch[:1]))
    with pytest.raises(TrainingError):
        run(pair.train_step([]))


def test_a_killed_single_trainer_is_a_trainer_died_error_in_a_few_words(group_ray, tiny_model_dir, batch):
    """One rank: its death reads as TrainerDiedError with its PID and Ray's exit type, not
    Ray's raw ActorDiedError text and its list of possible causes."""
    group = TrainerGroup.start(str(tiny_model_dir), TrainConfig(lr=LR, micro_batch_size=4),
                               [{"max_concurrency": 2}], **KWARGS)
    pids: list[int] = []
    try:
        pids = run(group.pids())
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(TrainerDiedError, match=f"^the trainer \\(pid {pids[0]}\\) died: ") as err:
            run(group.train_step(batch))
        message = str(err.value)
        assert "\n" not in message and "potential root causes" not in message and len(message) < 300, message
    finally:
        run(group.close())
    assert all(gone(p) for p in pids)


def test_actor_death_keeps_rays_exit_type_and_its_first_sentence():
    from ray.core.generated import common_pb2

    from rlix.errors import actor_death

    ctx = common_pb2.ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit type: "
                      "UNEXPECTED_SYSTEM_EXIT Worker exit detail: Worker unexpectedly exits with a connection "
                      "error code 2. End of file. There are some potential root causes. (1) The process is "
                      "killed by SIGKILL by OOM killer due to high memory usage.", pid=1234, class_name="TrainerRank",
        actor_id=b"\x01" * 16)
    exc = ray.exceptions.ActorDiedError(ctx)
    assert actor_death(exc) == ("UNEXPECTED_SYSTEM_EXIT (Worker unexpectedly exits with a connection "
                                "error code 2.)")
    assert actor_death(RuntimeError("it broke. Then more.")) == "it broke"


def test_killed_rank_fails_the_step_naming_it(group_ray, tiny_model_dir, batch):
    timeout_s = 30.0  # the survivor's rendezvous waits this long; the step must not
    group = TrainerGroup.start(str(tiny_model_dir), TrainConfig(lr=LR, micro_batch_size=4),
                               [{"max_concurrency": 2}] * 2, step_timeout_s=timeout_s, **KWARGS)
    pids: list[int] = []
    try:
        pids = run(group.pids())
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TrainerDiedError, match=f"trainer rank 1 of 2 \\(pid {pids[1]}\\) died"):
            run(group.train_step(batch))
        assert time.monotonic() - started < timeout_s / 2
        with pytest.raises(ray.exceptions.RayActorError):
            run(group.ping())
    finally:
        started = time.monotonic()
        run(group.close())  # rank 0 is still stuck in the step's rendezvous: close must not wait for it
        assert time.monotonic() - started < 15
    assert all(gone(p) for p in pids)


def test_fsdp_ranks_publish_the_unsharded_weights_and_train(group_ray, tiny_model_dir, batch, tmp_path):
    """`train.fsdp`: each rank keeps a shard; a published version (every rank's rows written
    into rank 0's cache) is bit-identical to an unsharded trainer's, and the ranks train, publish
    and checkpoint as a group."""
    cfg = TrainConfig(lr=LR, micro_batch_size=2, fsdp=True)
    sharded = TrainerGroup.start(str(tiny_model_dir), cfg, [{"max_concurrency": 2}] * 2,
                                 step_timeout_s=30, **KWARGS)
    single = TrainerGroup.start(str(tiny_model_dir), cfg, [{"max_concurrency": 2}], **KWARGS)

    async def scenario():  # type: ignore[no-untyped-def]
        assert sharded.sharded and not single.sharded  # one rank trains unsharded
        first = await sharded.publish(0, audit=True)
        await single.publish(0, audit=True)
        assert first.refs is not None and first.device_refs == {}
        assert await sharded.weight_checksums(0) == await single.weight_checksums(0)
        got, want = await asyncio.gather(sharded.train_step(batch), single.train_step(batch))
        assert got["num_tokens"] == want["num_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5)
        assert (await sharded.publish(1, audit=True)).versions == [0, 1]
        await sharded.offload()
        await sharded.reload(5.0)
        assert await sharded.save_checkpoint(str(tmp_path / "fsdp")) == 1
        assert (tmp_path / "fsdp" / "dcp" / ".metadata").is_file() and (tmp_path / "fsdp" / "model").is_dir()
        assert await sharded.load_checkpoint(str(tmp_path / "fsdp")) == 1

    try:
        run(scenario())
    finally:
        run(sharded.close())
        run(single.close())
