"""The ledger refuses every change that would break an invariant, and then is unchanged."""

from __future__ import annotations

import pytest

from rlix.errors import LedgerError
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import Grant, PipelineSpec, Plan, ShardMove, Stage, Topology


@pytest.fixture
def led() -> Ledger:
    led = Ledger(Topology.uniform(2, 4))
    led.register(PipelineSpec("a", train_gpus=4, tp=2, max_shards=3))
    led.register(PipelineSpec("b", train_gpus=2, max_shards=4, partial_overlap=False))
    led.apply(Plan(expands=[ShardMove("a", 0, (0, 1))]), 0.0)
    return led


def refused(led: Ledger, plan: Plan, match: str) -> None:
    before = led.snapshot()
    with pytest.raises(LedgerError, match=match):
        led.apply(plan, 1.0)
    assert led.snapshot() == before


def test_gpu_in_two_holdings(led):
    refused(led, Plan(expands=[ShardMove("a", 1, (1, 2))]), "still held")


def test_gpu_that_does_not_exist(led):
    refused(led, Plan(grants=[Grant(1, "a", Stage.TRAIN, (6, 7, 8, 9))]), "do not exist")


def test_shard_must_be_tp_gpus_on_one_node(led):
    refused(led, Plan(expands=[ShardMove("a", 1, (2,))]), "tp is 2")
    refused(led, Plan(expands=[ShardMove("a", 1, (3, 4))]), "several nodes")
    refused(led, Plan(expands=[ShardMove("a", 3, (2, 3))]), "dp rank outside")


def test_shrink_must_match_the_ledger(led):
    refused(led, Plan(shrinks=[ShardMove("a", 0, (2, 3))]), "do not match")
    refused(led, Plan(shrinks=[ShardMove("a", 2, (0, 1))]), "no such active shard")


def test_no_partial_overlap_keeps_train_and_generate_apart(led):
    home = sorted(led.train_home["b"])
    assert len(home) == 2
    refused(led, Plan(expands=[ShardMove("b", 0, (home[0],))]), "declares no partial overlap")
    outside = next(g for g in range(8) if g not in home and led.owner[g] is None)
    refused(led, Plan(grants=[Grant(1, "b", Stage.TRAIN, (outside, home[0]))]), "trains only on its home")


def test_partial_overlap_lets_train_take_own_shard_gpus(led):
    led.apply(Plan(shrinks=[ShardMove("a", 0, (0, 1))],
                   grants=[Grant(1, "a", Stage.TRAIN, (0, 1, 2, 3))]), 2.0)
    assert led.gpus_of("a") == [0, 1, 2, 3]


def test_a_bad_plan_changes_nothing_even_when_its_first_part_is_valid(led):
    refused(led, Plan(shrinks=[ShardMove("a", 0, (0, 1))],
                      expands=[ShardMove("a", 1, (2, 3)), ShardMove("a", 2, (2, 3))]), "still held")


def test_unregister_frees_everything(led):
    led.apply(Plan(grants=[Grant(1, "a", Stage.TRAIN, (4, 5, 6, 7))]), 1.0)
    assert led.unregister("a") == [0, 1, 4, 5, 6, 7]
    assert led.idle_gpus() == list(range(8))


def test_register_rejects_what_cannot_fit():
    led = Ledger(Topology.uniform(1, 4))
    with pytest.raises(LedgerError, match="exceeds the cluster"):
        led.register(PipelineSpec("x", train_gpus=5))
    with pytest.raises(LedgerError, match="does not fit on one node"):
        led.register(PipelineSpec("x", tp=8))
    with pytest.raises(LedgerError, match="leave no room"):
        led.register(PipelineSpec("x", train_gpus=4, partial_overlap=False))
    led.register(PipelineSpec("x"))
    with pytest.raises(LedgerError, match="already registered"):
        led.register(PipelineSpec("x"))


def test_release_what_is_not_held(led):
    with pytest.raises(LedgerError, match="holds no GPUs"):
        led.release("a", Stage.TRAIN)


def test_training_homes_on_slices_spread_over_physical_devices():
    """4 GPUs as 8 slices: four trainers get one device each (homes 0-3 would have put two
    trainers on each of GPUs 0 and 1 and none on 2 and 3); a two-rank trainer two devices."""
    led = Ledger(Topology.uniform(1, 4).sliced(2))
    for name in "abcd":
        led.register(PipelineSpec(name, train_gpus=1, max_shards=4, fixed_trainer=True))
    devices = [g // 2 for name in "abcd" for g in led.train_home[name]]
    assert sorted(devices) == [0, 1, 2, 3]
    led.register(PipelineSpec("e", train_gpus=2, max_shards=4, fixed_trainer=True))
    home = sorted(led.train_home["e"])
    assert len(home) == 2 and home[0] // 2 != home[1] // 2
    assert not set(home) & {g for name in "abcd" for g in led.train_home[name]}
