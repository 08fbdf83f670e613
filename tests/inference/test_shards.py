"""Routing rules of the router's shard table (pure, no servers)."""

from __future__ import annotations

import asyncio

import pytest

from rlix.errors import InvalidRequestError, NoActiveShardError
from rlix.inference.router.shard_table import Sessions, ShardState, ShardTable


def _table(active=(0, 1, 2), inactive=()) -> ShardTable:
    t = ShardTable()
    for r in active:
        t.set(r, f"http://s{r}", ShardState.ACTIVE)
    for r in inactive:
        t.set(r, f"http://s{r}", ShardState.INACTIVE)
    return t


def test_least_outstanding_and_only_active():
    t = _table(active=(0, 1), inactive=(2,))
    t.shards[0].outstanding = 3
    assert t.pick(None).rank == 1
    t.shards[1].outstanding = 5
    assert t.pick(None).rank == 0
    assert t.pick(None, frozenset({0, 1})) is None  # the inactive shard is never chosen


def test_sessions_are_sticky_and_move_only_from_a_leaving_shard():
    t = _table(active=(0, 1, 2, 3))
    before = {f"s{i}": t.pick(f"s{i}").rank for i in range(400)}
    assert sorted(before.values()).count(0) == 100  # equally loaded: new sessions spread evenly
    assert all(t.pick(s).rank == r for s, r in before.items())  # sticky
    t.set(2, state="preempted")
    after = {s: t.pick(s).rank for s in before}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s, r in before.items() if r == 2}  # only the leaving shard's sessions
    assert 2 not in after.values()
    assert all(list(after.values()).count(r) in (133, 134) for r in (0, 1, 3))  # and spread


def test_a_new_session_goes_to_the_least_loaded_shard_and_stays_there():
    t = _table(active=(0,))
    for i in range(4):
        assert t.pick(f"old{i}").rank == 0
    t.shards[0].outstanding = 32  # shard 0 is busy; shard 1 is woken
    t.set(1, "http://s1", ShardState.ACTIVE)
    new = [t.pick(f"new{i}").rank for i in range(8)]
    assert new == [1] * 8  # all new sessions go to the idle shard, none queue behind shard 0
    assert t.pick("old0").rank == 0  # an old session stays where its prefix is cached
    t.shards[1].outstanding = 40
    assert t.pick("new0").rank == 1  # sticky while its shard is active, even when busier
    assert t.pick("newer").rank == 0
    assert t.pick("new0", frozenset({1})).rank == 0  # excluded (a failed attempt): placed anew
    assert t.pick("new0").rank == 0  # and it stays there


def test_sessions_forget_the_least_recently_used_beyond_their_limit():
    s = Sessions(limit=2)
    s.place("a", 0)
    s.place("b", 1)
    assert s.get("a") == 0  # a is now the most recently used
    s.place("c", 1)
    assert s.get("b") is None and s.get("a") == 0 and s.get("c") == 1
    assert s.count == {0: 1, 1: 1}
    s.place("a", 1)  # moved: counted once, on its new rank
    assert s.count == {0: 0, 1: 2}


def test_requests_wait_for_an_active_shard_then_time_out():
    async def main():
        t = _table(active=(), inactive=(0,))
        waiter = asyncio.create_task(t.acquire(None, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # held, not failed
        t.set(0, state="active")
        shard = await asyncio.wait_for(waiter, 1)
        assert shard.rank == 0 and shard.outstanding == 1
        t.release(shard, True)
        t.set(0, state="inactive")
        with pytest.raises(NoActiveShardError):
            await t.acquire("sess", timeout_s=0.05)
    asyncio.run(main())


def test_bad_admin_input():
    t = ShardTable()
    with pytest.raises(InvalidRequestError, match="give its url"):
        t.set(3, state="active")
    with pytest.raises(InvalidRequestError, match="unknown shard state"):
        t.set(3, "http://x", "sleepy")


def test_flip_from_another_thread_routes_at_once_and_notify_wakes_held_requests():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        t = _table(active=(0,), inactive=(1,))
        # taken out of rotation from another thread: the very next pick sees it
        await loop.run_in_executor(None, t.flip, 0, "preempted")
        assert t.pick(None) is None and t.pick("session") is None and t.is_preempted(0)
        held = asyncio.create_task(t.acquire("session", timeout_s=5))
        await asyncio.sleep(0.05)
        assert not held.done()
        await loop.run_in_executor(None, t.flip, 1, ShardState.ACTIVE)
        await asyncio.sleep(0.05)
        assert not held.done()  # a flip alone wakes nobody ...
        await loop.run_in_executor(None, lambda: loop.call_soon_threadsafe(t.notify))
        assert (await asyncio.wait_for(held, 1)).rank == 1  # ... notify on the loop does
        with pytest.raises(InvalidRequestError, match="unknown"):
            t.flip(7, "active")
        with pytest.raises(InvalidRequestError, match="unknown shard state"):
            t.flip(1, "asleep")

    asyncio.run(main())
