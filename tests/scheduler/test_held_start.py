"""A run's scheduler started held and not waited for (`start_scheduler(held=True, wait=False)`):
`rlix run` starts its pipelines' actors beside it, so a registration can reach it before the
run has confirmed it is up. It must plan nothing until `resume`, and say when it started and
when each registration arrived (what a set-up's `reserve` waited for)."""

from __future__ import annotations

import time

import pytest
import ray

from rlix.errors import SchedulerError
from rlix.scheduler.service import check_scheduler, start_scheduler
from rlix.scheduler.types import PipelineSpec, Topology
from test_service import PARAMS, FakeCoordinator, poll, shards, snap


def test_a_scheduler_started_held_plans_nothing_until_resumed_and_says_when_it_started(ray_cluster):
    topology = Topology((2,))
    sent_at = time.time()
    sched = start_scheduler(topology, PARAMS, held=True, wait=False)
    coord = FakeCoordinator.remote()
    ray_cluster += [sched, coord]
    # sent before anyone confirmed the actor is up: it queues, and is answered once it is
    ray.get(sched.register.remote(PipelineSpec("a", max_shards=2), coord), timeout=30)
    check_scheduler(sched, topology)
    with pytest.raises(SchedulerError, match="already running with topology"):
        check_scheduler(sched, Topology((4,)))
    time.sleep(0.5)  # a plan, had one been made, would have been sent by now
    assert not shards(snap(sched), "a") and not ray.get(coord.get_calls.remote())

    ray.get(sched.resume.remote())
    poll(lambda: len(shards(snap(sched), "a")) == 2, what="both GPUs planned for a after resume")
    times = ray.get(sched.startup_times.remote())
    arrived, answered = times["registered"]["a"]
    assert sent_at <= times["init_at"] <= times["up_at"] <= arrived <= answered <= time.time()

