"""A node leaving the cluster: its GPUs leave the ledger for good, the shards there are dropped,
a pipeline whose training home was there is reported, and the rest of the cluster is re-planned
without the lost GPUs."""

from __future__ import annotations

import pytest

from rlix.errors import LedgerError
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Plan, ShardMove, Topology


def core_with(*specs: PipelineSpec) -> SchedulerCore:
    core = SchedulerCore(Topology.uniform(2, 2), PlannerParams(dwell_s=0.0), clock=lambda: 0.0)
    for s in specs:
        core.register(s)
    return core


def test_lost_gpus_drop_their_shards_and_are_never_planned_again():
    core = core_with(PipelineSpec("a", max_shards=4), PipelineSpec("b", max_shards=4))
    core.replan("start")
    assert core.ledger.idle_gpus() == []
    node1 = [2, 3]
    on_node1 = {(h.pipeline, h.dp_rank) for h in core.ledger.holdings.values() if set(h.gpus) & set(node1)}
    lost = core.gpus_lost(node1)
    assert lost.gpus == node1
    assert {(m.pipeline, m.dp_rank) for m in lost.shards} == on_node1
    assert lost.homeless == [] and lost.training == []
    for _ in range(3):
        core.replan("after the loss")
    held = [g for h in core.ledger.holdings.values() for g in h.gpus]
    assert sorted(held) == [0, 1], "the surviving node is used, the lost one never"
    assert core.ledger.idle_gpus() == []
    assert core.snapshot()["ledger"]["lost"] == node1
    # both pipelines keep one shard each on the surviving node
    assert {h.pipeline for h in core.ledger.holdings.values()} == {"a", "b"}


def test_a_pipeline_whose_training_home_was_lost_is_named():
    core = core_with(PipelineSpec("a", train_gpus=1, max_shards=2, fixed_trainer=True),
                     PipelineSpec("b", train_gpus=1, max_shards=2, fixed_trainer=True))
    homes = {n: sorted(h) for n, h in core.ledger.train_home.items()}
    lost_node = core.ledger.node_of[homes["b"][0]]
    gpus = [g for g in range(4) if core.ledger.node_of[g] == lost_node]
    lost = core.gpus_lost(gpus)
    assert "b" in lost.homeless
    assert ("a" in lost.homeless) == (core.ledger.node_of[homes["a"][0]] == lost_node)


def test_the_ledger_refuses_a_holding_on_a_lost_gpu():
    core = core_with(PipelineSpec("a", max_shards=4))
    core.gpus_lost([3])
    with pytest.raises(LedgerError, match="left the cluster"):
        core.ledger.apply(Plan(expands=[ShardMove("a", 0, (3,))]), 0.0)
    assert core.ledger.holdings == {}
