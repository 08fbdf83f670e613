"""Fixtures the scheduler's Ray tests share."""

from __future__ import annotations

import pytest
import ray

from rlix.scheduler.service import ACTOR_NAME, NAMESPACE


@pytest.fixture()
def ray_cluster():
    """A fresh local Ray (2 CPUs, 2 fake GPUs) for one test; yields a list the test appends its
    actors to. Each is killed after the test, and so is the scheduler actor if one was started."""
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, namespace="rlix-test",
             logging_level="warning")
    actors: list = []
    try:
        yield actors
    finally:
        for handle in actors:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        try:
            ray.kill(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE))
        except Exception:  # noqa: BLE001 - none was started, or it is gone
            pass
        ray.shutdown()
