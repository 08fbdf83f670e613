"""Selective sync into real engine-server processes: buckets over shared memory, control over
HTTP. Shards not synced keep generating throughout; a bad layout or a dead sender changes
nothing that serves."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

from rlix.errors import WeightSyncError
from rlix.weights.http_endpoint import http_endpoints
from rlix.weights import BucketCache, WeightSync
from rlix.weights.wire import reap_orphaned_segments
from kit import AUTH, KEY, shard_processes

PROMPT = [5, 17, 42, 99, 7, 3]


def served_state(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype)).contiguous()
            for n, t in state.items()}


async def greedy(http: httpx.AsyncClient, url: str, tokens: int = 12) -> tuple[list[int], list[int]]:
    r = await http.post(f"{url}/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": tokens,
                                                 "ignore_eos": True}})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], [int(span["version"]) for span in choice.get("weight_versions") or []]


async def versions(http: httpx.AsyncClient, urls: dict[int, str]) -> list[int]:
    out = []
    for r in sorted(urls):
        resp = await http.get(f"{urls[r]}/weight_info", headers=AUTH)
        out.append(int(resp.json()["weight_version"]))
    return out


@pytest.fixture(scope="module")
def four_shards(tiny_model_dir):
    with shard_processes(tiny_model_dir, 4) as procs:
        yield {i: p.url for i, p in enumerate(procs)}


def test_sync_to_1_and_3_of_four_servers_while_0_and_2_keep_generating(four_shards, tiny_model_dir):
    urls = four_shards
    new = perturbed(served_state(tiny_model_dir), seed=1)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            before = {r: (await greedy(http, u))[0] for r, u in urls.items()}
            assert len({tuple(t) for t in before.values()}) == 1  # same weights everywhere
            done: dict[int, list[tuple[float, float, list[int]]]] = {0: [], 2: []}
            stop = asyncio.Event()

            async def load(rank: int) -> None:  # keeps the unsynced shards busy
                while not stop.is_set():
                    t0 = time.monotonic()
                    _, vers = await greedy(http, urls[rank], tokens=8)
                    done[rank].append((t0, time.monotonic(), vers))

            loaders = [asyncio.create_task(load(r)) for r in (0, 0, 2, 2)]
            await asyncio.sleep(0.3)
            with BucketCache.for_model(new, bucket_bytes=32 << 10) as cache:
                cache.build_latest(1, new)
                sync = WeightSync(cache, http_endpoints(urls, KEY), "shm", one_call=False)  # bucket by bucket
                t_start = time.monotonic()
                report = await sync.sync(1, [3, 1])
                t_end = time.monotonic()
                assert report.ranks == [1, 3] and report.buckets == cache.layout.num_buckets > 20
                assert not report.bundled
            stop.set()
            await asyncio.gather(*loaders)

            assert await versions(http, urls) == [0, 1, 0, 1]
            after = {r: (await greedy(http, u))[0] for r, u in urls.items()}
            assert after[0] == after[2] == before[0]  # untouched
            assert after[1] == after[3] != before[1]  # both moved to the same new weights
            for rank in (0, 2):  # requests ran to completion on 0 and 2 during the sync
                during = [v for s, e, v in done[rank] if s >= t_start and e <= t_end]
                assert during, f"shard {rank} finished no request during the {t_end - t_start:.2f}s sync"
                assert all(set(v) <= {0} for _, _, v in done[rank])

    asyncio.run(main())


def test_mismatched_layout_is_refused_before_any_bytes(four_shards, tiny_model_dir):
    urls = {0: four_shards[0]}
    state = served_state(tiny_model_dir)
    name = next(n for n, t in state.items() if t.dim() == 2)
    wrong = dict(state)
    wrong[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1], dtype=state[name].dtype)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            version_before = (await versions(http, urls))[0]
            before, _ = await greedy(http, urls[0])
            with BucketCache.for_model(wrong, bucket_bytes=256 << 10) as cache:
                cache.build_latest(version_before + 5, wrong)
                with pytest.raises(WeightSyncError, match="layout refused.*shape") as info:
                    await WeightSync(cache, http_endpoints(urls, KEY), "shm").sync(version_before + 5, [0])
                assert info.value.failed.keys() == {0} and info.value.succeeded == []
            status = (await http.get(f"{urls[0]}/weight_transfer_status", headers=AUTH)).json()
            assert status["updating"] is None and status["buckets_received"] == 0
            assert "does not match the model" in status["last_error"]
            assert (await versions(http, urls))[0] == version_before
            assert (await greedy(http, urls[0]))[0] == before

    asyncio.run(main())


DYING_SENDER = textwrap.dedent("""
    import asyncio, os, sys, torch
    from safetensors.torch import load_file
    from rlix.weights.http_endpoint import http_endpoints
    from rlix.weights import BucketCache, WeightSync

    url, model_file = sys.argv[1], sys.argv[2]
    gen = torch.Generator().manual_seed(9)
    new = {n: (t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype)).contiguous()
           for n, t in load_file(model_file).items()}
    cache = BucketCache.for_model(new, bucket_bytes=32 << 10)
    cache.build_latest(7, new)
    endpoints = http_endpoints({0: url}, "%s")
    pushed = 0
    real_push = endpoints[0].push

    async def push(message):
        global pushed
        await real_push(message)
        pushed += 1
        if pushed == 5:
            print("dying", os.getpid(), flush=True)
            os._exit(17)  # mid-transfer, without aborting or closing anything

    endpoints[0].push = push
    asyncio.run(WeightSync(cache, endpoints, "shm", idle_timeout_s=1.0, one_call=False).sync(7, [0]))
""")


def test_sender_dying_mid_transfer_leaves_old_weights_and_the_shard_syncable(four_shards, tiny_model_dir, tmp_path):
    urls = {0: four_shards[2]}
    script = tmp_path / "dying_sender.py"
    script.write_text(DYING_SENDER % KEY)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            version_before = (await versions(http, urls))[0]
            before, _ = await greedy(http, urls[0])
            proc = subprocess.run([sys.executable, str(script), urls[0],
                                   str(tiny_model_dir / "model.safetensors")],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 17 and "dying" in proc.stdout, proc.stderr[-2000:]
            status = (await http.get(f"{urls[0]}/weight_transfer_status", headers=AUTH)).json()
            assert status["updating"] == 7 and 0 < status["buckets_received"] < status["buckets_total"]
            assert (await greedy(http, urls[0]))[0] == before  # old weights serve meanwhile
            deadline = time.monotonic() + 10
            while status["updating"] is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                status = (await http.get(f"{urls[0]}/weight_transfer_status", headers=AUTH)).json()
            assert status["updating"] is None, status
            assert "no message from the sender" in status["last_error"]
            assert (await versions(http, urls))[0] == version_before
            assert (await greedy(http, urls[0]))[0] == before
            # the shard is not wedged: a new driver syncs it
            new = perturbed(served_state(tiny_model_dir), seed=3)
            with BucketCache.for_model(new, bucket_bytes=256 << 10) as cache:
                cache.build_latest(8, new)
                await WeightSync(cache, http_endpoints(urls, KEY), "shm").sync(8, [0])
            assert (await versions(http, urls))[0] == 8
            assert (await greedy(http, urls[0]))[0] != before
            # the dead sender's cache segments are orphans now: reaped by pid
            dead = int(proc.stdout.split()[1])
            assert any(n.startswith(f"rlix-w-{dead}-") for n in reap_orphaned_segments("rlix-w"))
            assert not any(n.startswith(f"rlix-w-{dead}-") for n in os.listdir("/dev/shm"))

    asyncio.run(main())


async def is_sleeping(http: httpx.AsyncClient, url: str) -> bool:
    return (await http.get(f"{url}/is_sleeping", headers=AUTH)).json()["is_sleeping"]


def test_one_call_sync_wakes_a_sleeping_shard_and_it_reports_the_new_version(four_shards, tiny_model_dir):
    urls = {0: four_shards[3]}
    new = perturbed(served_state(tiny_model_dir), seed=4)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            version_before = (await versions(http, urls))[0]
            before, _ = await greedy(http, urls[0])
            (await http.post(f"{urls[0]}/sleep", params={"level": 1}, headers=AUTH)).raise_for_status()
            assert await is_sleeping(http, urls[0])
            target = version_before + 3
            with BucketCache.for_model(new, bucket_bytes=32 << 10) as cache:
                cache.build_latest(target, new)
                report = await WeightSync(cache, http_endpoints(urls, KEY), "shm").sync(target, [0], wake=[0])
            assert report.bundled and report.reported == {0: target} and report.buckets > 20
            # where the shard's time went, as it timed it: every phase, the buckets' split inside
            phases = report.shard_phases_ms[0]
            assert {"wake", "start", "buckets", "finish", "bucket_receive"} <= set(phases)
            assert all(v >= 0 for v in phases.values()) and phases["wake"] > 0
            assert sum(phases[k] for k in ("wake", "start", "buckets", "finish")) <= 1000 * report.seconds
            assert not await is_sleeping(http, urls[0])
            assert (await versions(http, urls))[0] == target
            after, spans = await greedy(http, urls[0])
            assert after != before and set(spans) == {target}
            # the step-by-step protocol wakes with its own call first
            (await http.post(f"{urls[0]}/sleep", params={"level": 1}, headers=AUTH)).raise_for_status()
            with BucketCache.for_model(new, bucket_bytes=32 << 10) as cache:
                cache.build_latest(target + 1, new)
                report = await WeightSync(cache, http_endpoints(urls, KEY), "shm",
                                          one_call=False).sync(target + 1, [0], wake=[0])
            assert not report.bundled and report.ranks == [0]
            assert not await is_sleeping(http, urls[0])
            assert (await versions(http, urls))[0] == target + 1

    asyncio.run(main())


def test_one_call_sync_refuses_bad_bodies_and_a_failed_update_keeps_the_old_weights(four_shards, tiny_model_dir):
    url = four_shards[1]
    new = perturbed(served_state(tiny_model_dir), seed=5)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            with BucketCache.for_model(new, bucket_bytes=32 << 10) as cache:
                layout_id = cache.layout.layout_id
                first = (await versions(http, {0: url}))[0] + 1
                cache.build_latest(first, new)
                await WeightSync(cache, http_endpoints({0: url}, KEY), "shm").sync(first, [0])  # layout known
            version_before = (await versions(http, {0: url}))[0]
            before, _ = await greedy(http, url)
            (await http.post(f"{url}/sleep", params={"level": 1}, headers=AUTH)).raise_for_status()
            good = {"weight_version": version_before + 1, "layout_id": layout_id, "wake_up": True,
                    "updates": [{"version": version_before + 1, "bucket": 0, "nbytes": 64,
                                 "shm": "rlix-no-such-segment", "offset": 0}]}
            for field, bad in (("weight_version", None), ("layout_id", None), ("updates", []),
                               ("updates", [{"not": "a bucket"}]), ("wake_up", "yes"), ("transfer", [1])):
                r = await http.post(f"{url}/sync_weights", json={**good, field: bad}, headers=AUTH)
                assert r.status_code == 400, (field, r.text)
                assert await is_sleeping(http, url), field  # refused before anything changed
            r = await http.post(f"{url}/sync_weights", json=good, headers=AUTH)  # a segment that is not there
            assert r.status_code == 400 and "old weights keep serving" in r.json()["error"]["message"]
            status = (await http.get(f"{url}/weight_transfer_status", headers=AUTH)).json()
            assert status["updating"] is None and status["last_error"]
            assert (await versions(http, {0: url}))[0] == version_before
            assert (await greedy(http, url))[0] == before

    asyncio.run(main())
