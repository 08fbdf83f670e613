"""Replay buffer: staleness bound, oldest-first, accounting that never loses a trajectory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix.errors import AccountingError, RlixError
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.types import Group, Trajectory


def group(gid: str, version: int, n: int = 4) -> Group:
    return Group(gid, "p", [Trajectory(f"{gid}-{i}", gid, [1], [2], [-0.5], 0.0, version, [version])
                            for i in range(n)])


def test_group_version_is_its_oldest_trajectory():
    g = group("g", 3)
    g.trajectories[1].version = 1
    assert g.version == 1 and len(g) == 4


def test_take_drops_stale_groups_with_a_reason_and_returns_oldest_valid_first():
    buf = ReplayBuffer()
    for gid, v in (("old", 0), ("b", 2), ("a", 1), ("c", 2)):
        buf.note_started(4)
        buf.put(group(gid, v))
    assert buf.valid_count(current_version=2, max_age=1) == 12
    assert buf.valid_groups(current_version=2, max_age=1) == 3
    taken = buf.take(2, current_version=2, max_age=1)
    assert [g.group_id for g in taken] == ["a", "b"]  # by version, then arrival
    assert buf.accounting() == {"started": 16, "trained": 8, "dropped": {"stale": 4}, "buffered": 4}
    buf.check_conservation()
    with pytest.raises(RlixError, match="1 valid groups, 2 asked"):
        buf.take(2, current_version=2, max_age=1)
    assert len(buf) == 4  # a refused take takes nothing
    buf.close()
    buf.close()  # idempotent
    assert buf.accounting()["dropped"] == {"stale": 4, "unused at shutdown": 4}
    buf.note_started(4)
    buf.put(group("late", 2))  # a straggler after close is accounted, not kept
    assert len(buf) == 0
    buf.check_conservation()


def test_drop_stale_counts_trajectories_not_groups():
    buf = ReplayBuffer()
    buf.note_started(5)
    buf.put(group("a", 0, n=2))
    buf.put(group("b", 3, n=3))
    assert buf.drop_stale(current_version=3, max_age=2) == 2
    assert buf.drop_stale(current_version=3, max_age=2) == 0
    assert buf.accounting()["dropped"] == {"stale": 2} and len(buf) == 3


def test_conservation_fails_loudly_when_trajectories_go_missing():
    buf = ReplayBuffer()
    buf.note_started(8)
    buf.put(group("a", 0))
    with pytest.raises(AccountingError, match="8 trajectories started but 4"):
        buf.check_conservation()
    buf.check_conservation(in_flight=4)
    with pytest.raises(RlixError):
        buf.put(Group("empty", "p", []))


OPS = st.lists(st.tuples(st.sampled_from(["start", "finish", "fail", "take", "bump"]),
                         st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(0, 3), st.integers(1, 4))
def test_never_trains_beyond_the_staleness_bound_and_always_conserves(ops, max_age, size):
    """Random interleavings of starting groups, finishing them (possibly with old versions),
    failing them, taking batches and bumping the version."""
    buf, version, in_flight, n = ReplayBuffer(), 0, [], 0
    for op, k in ops:
        if op == "start":
            n += 1
            buf.note_started(size)
            in_flight.append((f"g{n}", version))  # generation starts at the current version
        elif op == "finish" and in_flight:
            gid, v = in_flight.pop(k % len(in_flight))
            g = group(gid, v, size)
            if buf.fresh(g.version, version, max_age):
                buf.put(g)
            else:
                buf.note_dropped(size, "stale")
        elif op == "fail" and in_flight:
            in_flight.pop(k % len(in_flight))
            buf.note_dropped(size, "generate failed: test")
        elif op == "take":
            want = k + 1
            if buf.valid_groups(version, max_age) >= want:
                taken = buf.take(want, version, max_age)
                assert len(taken) == want
                assert all(g.version >= version - max_age for g in taken)
                assert [g.version for g in taken] == sorted(g.version for g in taken)
            else:
                with pytest.raises(RlixError):
                    buf.take(want, version, max_age)
        elif op == "bump":
            version += 1
            if k == 0:
                buf.drop_stale(version, max_age)
        buf.check_conservation(in_flight=size * len(in_flight))
    buf.close()
    buf.check_conservation(in_flight=size * len(in_flight))
    acc = buf.accounting()
    assert acc["buffered"] == 0 and acc["trained"] % size == 0
