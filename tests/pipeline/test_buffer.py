"""Replay buffer: staleness bound, accounting, throttled progress."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix.errors import RlixError
from rlix.pipeline.buffer import AccountingError, ReplayBuffer
from rlix.pipeline.hooks import ProgressThrottle
from rlix.pipeline.types import Group, Trajectory


def group(gid: str, version: int, n: int = 4) -> Group:
    return Group(gid, "p", [Trajectory(f"{gid}-{i}", gid, [1], [2], [-0.5], 0.0, version, [version])
                            for i in range(n)])


def test_take_drops_stale_groups_with_a_reason_and_returns_oldest_valid_first():
    buf = ReplayBuffer()
    for gid, v in (("old", 0), ("a", 1), ("b", 2), ("c", 2)):
        buf.note_started(4)
        buf.put(group(gid, v))
    assert buf.valid_count(current_version=2, max_age=1) == 12
    taken = buf.take(2, current_version=2, max_age=1)
    assert [g.group_id for g in taken] == ["a", "b"]
    assert buf.accounting() == {"started": 16, "trained": 8, "dropped": {"stale": 4}, "buffered": 4}
    buf.check_conservation()
    with pytest.raises(RlixError, match="1 valid groups, 2 asked"):
        buf.take(2, current_version=2, max_age=1)
    buf.close()
    assert buf.accounting()["dropped"] == {"stale": 4, "unused at shutdown": 4}
    buf.check_conservation()


def test_conservation_fails_loudly_when_trajectories_go_missing():
    buf = ReplayBuffer()
    buf.note_started(8)
    buf.put(group("a", 0))
    with pytest.raises(AccountingError, match="8 trajectories started but 4"):
        buf.check_conservation()
    buf.check_conservation(in_flight=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "take", "bump", "drop"]), st.integers(0, 3)), max_size=40),
       st.integers(0, 2))
def test_never_trains_beyond_the_staleness_bound_and_always_conserves(ops, max_age):
    buf, version, in_flight, n = ReplayBuffer(), 0, 0, 0
    for op, k in ops:
        if op == "put":
            n += 1
            buf.note_started(4)
            buf.put(group(f"g{n}", max(version - k, 0)))
        elif op == "take" and buf.valid_groups(version, max_age) >= 1:
            for g in buf.take(1, version, max_age):
                assert g.version >= version - max_age
        elif op == "bump":
            version += 1
        elif op == "drop":
            buf.note_started(4)
            buf.note_dropped(4, "generate failed: test")
        buf.check_conservation(in_flight)


def test_progress_is_reported_at_2_percent_steps_ends_and_target_changes():
    throttle = ProgressThrottle()
    reports = [c for c in range(0, 101) if throttle.should_report(c, 100)]
    assert reports == list(range(0, 100, 2)) + [100]
    assert not throttle.should_report(100, 100)
    assert throttle.should_report(100, 200)  # new target
    assert [c for c in range(0, 11) if throttle.should_report(c, 10)] == list(range(0, 11))
