"""TrainerActor: one step and the between-step calls through a local Ray."""

from __future__ import annotations

import dataclasses

import pytest
import ray

from rlix.errors import TrainingError


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_one_step_through_the_actor(local_ray, tiny_model_dir, samples_factory, tmp_path):
    from rlix.config.models import TrainConfig
    from rlix.training.ranks import TrainerActor

    actor = TrainerActor.remote(str(tiny_model_dir), TrainConfig(micro_batch_size=4))
    samples = samples_factory(6, seed=60)
    behaviour = ray.get(actor.compute_logprobs.remote(samples))
    for s, lp in zip(samples, behaviour):
        s.behaviour_logprobs = lp
    metrics = ray.get(actor.train_step.remote(samples))
    assert metrics["step"] == 1 and metrics["num_samples"] == 6
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5)  # on-policy: behaviour == current
    info = ray.get(actor.publish.remote(1))
    assert info.version == 1 and info.num_buckets >= 1 and info.bytes > 0 and info.versions == [1]
    ray.get([actor.offload.remote(), actor.reload.remote()])
    ray.get(actor.save_checkpoint.remote(str(tmp_path / "ckpt")))
    # dict samples work too (callers outside Python's dataclass world)
    ray.get(actor.train_step.remote([dataclasses.asdict(s) for s in samples]))
    assert ray.get(actor.load_checkpoint.remote(str(tmp_path / "ckpt"))) == 1
    with pytest.raises(TrainingError):
        ray.get(actor.train_step.remote([]))
    ray.get(actor.close.remote())
    ray.kill(actor)
