"""ShardRate: shard-seconds per finished trajectory, counted only while work was in flight."""

from __future__ import annotations

from rlix.pipeline.rollout.rate import ShardRate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_two_shards_for_ten_seconds_over_forty_trajectories_is_half_a_second_each() -> None:
    clock, shards = Clock(), [2]
    rate = ShardRate(lambda: shards[0], clock=clock)
    assert rate.seconds_per_trajectory() is None  # nothing finished yet
    rate.tick(True)
    clock.t = 5.0
    rate.tick(True, finished=16)
    clock.t = 10.0
    rate.tick(True, finished=24)
    assert rate.seconds_per_trajectory() == 2 * 10 / 40


def test_idle_time_and_time_without_shards_are_not_counted() -> None:
    clock, shards = Clock(), [1]
    rate = ShardRate(lambda: shards[0], clock=clock)
    rate.tick(False)  # nothing in flight: the next 100 s do not count
    clock.t = 100.0
    rate.tick(True)
    clock.t = 104.0
    rate.tick(True, finished=8)
    assert rate.seconds_per_trajectory() == 4 / 8
    shards[0] = 0
    rate.tick(True)
    clock.t = 200.0
    rate.tick(True, finished=8)  # no shard held: the trajectories cost no shard-seconds
    assert rate.seconds_per_trajectory() == 4 / 16


def test_the_window_keeps_the_latest_ticks() -> None:
    clock = Clock()
    rate = ShardRate(lambda: 1, window=2, clock=clock)
    rate.tick(True)
    for dt in (10.0, 1.0, 1.0):  # a slow start, then faster
        clock.t += dt
        rate.tick(True, finished=1)
    assert rate.seconds_per_trajectory() == 1.0
