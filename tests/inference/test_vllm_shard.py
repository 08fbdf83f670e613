"""A real vLLM CPU server as an rlix shard: weight sync through rlix's worker extension, checked
with vLLM's own /weight_checker; failed updates leave the old weights serving; preemption drains
and pauses it (vLLM refuses sleep mode on CPU) and what it aborted is re-dispatched."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from kit import KEY, need_vllm
from rlix.inference.server.openai_schema import GenerateSamplingParams as SP
from rlix.errors import WeightSyncError, WeightUpdateError
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.inference.router.router import Router
from rlix.weights.cache import BucketCache
from rlix.weights.sync import WeightSync
from rlix.weights.transport import make_transport
from rlix.weights.vllm.endpoint import VllmShardEndpoint
from rlix.weights.vllm.names import compare_digests, vllm_digests
from rlix.weights.wire import reap_orphaned_segments

pytestmark = pytest.mark.vllm
BUCKET = 256 << 10  # several buckets for the tiny model, so "part-way" means something


@pytest.fixture(scope="module")
def vllm_shard(tiny_model_dir):
    need_vllm()
    backend = make_backend(EngineBackendConfig(backend="vllm", model=str(tiny_model_dir), served_model_name="tiny",
                                               max_model_len=512, max_num_seqs=16, dtype="bfloat16",
                                               startup_timeout_s=600))
    proc = ShardProcess(backend, KEY)
    try:
        proc.start()
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
    assert not proc.alive()


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def served_digests(url: str) -> dict[str, str]:
    out = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=60).json()
    return {n.rsplit(":", 1)[-1]: d for n, d in out["checksums"].items()}


def served_version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]


def generate_versions(url: str) -> list[str]:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "temperature": 0}}
    r = httpx.post(url + "/inference/v1/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return [s["version"] for s in r.json()["choices"][0]["weight_versions"]]


def expect(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    tied = {n: t for n, t in weights.items() if n != "lm_head.weight"}
    return vllm_digests(tied, torch.bfloat16)


def scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {n: t * factor for n, t in weights.items()}


async def sync_to(url: str, weights: dict[str, torch.Tensor], version: int, verify: bool = False) -> None:
    ep = VllmShardEndpoint(url, KEY, "shard 0")
    try:
        with BucketCache.for_model(weights, bucket_bytes=BUCKET, host="shm") as cache:
            cache.build_latest(version, weights)
            report = await WeightSync(cache, {0: ep}, "shm", verify=verify).sync(version, [0])
            assert report.bundled and report.reported == {0: version}
    finally:
        await ep.aclose()


def test_sync_is_served_and_equals_the_trainers_weights(vllm_shard, weights):
    url = vllm_shard.url
    assert served_version(url) == "0" and generate_versions(url) == ["0"]  # set once healthy
    assert compare_digests(expect(weights), served_digests(url)) == []  # loaded from disk
    new = scaled(weights, 0.5)
    asyncio.run(sync_to(url, new, 1))
    assert compare_digests(expect(new), served_digests(url)) == []
    assert compare_digests(expect(weights), served_digests(url)) != []
    assert served_version(url) == "1" and generate_versions(url) == ["1"]
    asyncio.run(sync_to(url, weights, 2, verify=True))  # with per-bucket checksums checked
    assert compare_digests(expect(weights), served_digests(url)) == []


SENDER = textwrap.dedent("""
    import json, sys, time, torch
    from rlix.weights.cache import BucketCache
    sd = torch.load(sys.argv[1])
    cache = BucketCache.for_model(sd, bucket_bytes=int(sys.argv[2]), host="shm")
    cache.build_latest(7, sd)
    from rlix.weights.transport import make_transport
    sender = make_transport("shm", segments=cache.shm_segments).sender()
    msgs = sender.references(7, cache.buckets(7), cache.checksums(7))
    print(json.dumps({"layout": cache.layout.to_json(), "layout_id": cache.layout.layout_id,
                      "messages": msgs}), flush=True)
    time.sleep(600)
""")


def messages_of(cache: BucketCache, version: int) -> list[dict]:
    """The shm transport's message for each bucket of a cached version, as the driver sends them."""
    sender = make_transport("shm", segments=cache.shm_segments).sender()
    return sender.references(version, cache.buckets(version), cache.checksums(version))


def test_failed_updates_leave_the_old_weights_serving(vllm_shard, weights, tmp_path):
    url = vllm_shard.url
    asyncio.run(sync_to(url, weights, 3))
    before, version = served_digests(url), served_version(url)

    async def attempt(layout_json: str, layout_id: str, messages: list[dict], verify: bool = False) -> None:
        ep = VllmShardEndpoint(url, KEY, "shard 0")
        try:
            await ep.init_transfer({"layout": layout_json, "transport": "shm", "verify": verify})
            await ep.sync(7, layout_id, {}, messages)
        finally:
            await ep.aclose()

    # the sender is killed by its PID before the shard reads its buckets: its cache is reaped
    torch.save(scaled(weights, 2.0), tmp_path / "sd.pt")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(tmp_path / "sd.pt"), str(BUCKET)],
                              stdout=subprocess.PIPE, text=True)
    try:
        job = json.loads(sender.stdout.readline())
    finally:
        os.kill(sender.pid, signal.SIGKILL)
        sender.wait(10)
    assert len(job["messages"]) > 2
    names = {m["shm"] for m in job["messages"]}
    assert names <= set(reap_orphaned_segments("rlix-w"))  # what rlix does once a trainer is dead
    with pytest.raises(WeightUpdateError, match="cannot open shared memory"):
        asyncio.run(attempt(job["layout"], job["layout_id"], job["messages"]))
    assert served_digests(url) == before and served_version(url) == version

    # a bad bucket (its checksum does not match) and an update cut short part-way
    new = scaled(weights, 2.0)
    with BucketCache.for_model(new, bucket_bytes=BUCKET, host="shm") as cache:
        cache.build_latest(7, new)
        msgs = messages_of(cache, 7)
        bad = [dict(m) for m in msgs]
        bad[1]["checksum"] ^= 1
        with pytest.raises(WeightUpdateError, match="checksum"):
            asyncio.run(attempt(cache.layout.to_json(), cache.layout.layout_id, bad, verify=True))
        assert served_digests(url) == before and served_version(url) == version
        with pytest.raises(WeightUpdateError, match="incomplete"):
            asyncio.run(attempt(cache.layout.to_json(), cache.layout.layout_id, msgs[:-1]))
        assert served_digests(url) == before and served_version(url) == version
    # and the next sync succeeds
    asyncio.run(sync_to(url, new, 8))
    assert compare_digests(expect(new), served_digests(url)) == [] and served_version(url) == "8"


def test_a_driver_sync_that_fails_names_the_shard(vllm_shard, weights):
    """Through WeightSync (what the trainer runs): a refused layout is reported, typed."""
    wrong = {"not.a.param": torch.zeros(4, 4)}

    async def main() -> None:
        ep = VllmShardEndpoint(vllm_shard.url, KEY, "shard 0")
        try:
            with BucketCache.for_model(wrong, host="shm") as cache:
                cache.build_latest(9, wrong)
                await WeightSync(cache, {0: ep}, "shm").sync(9, [0])
        finally:
            await ep.aclose()

    with pytest.raises(WeightSyncError, match="shard 0.*layout refused.*does not fit"):
        asyncio.run(main())


class _Running:
    """A launcher over the module's one server (a second vLLM start costs a minute here)."""

    def __init__(self, proc: ShardProcess) -> None:
        self.proc = proc

    async def start(self, rank: int, gpus=()) -> str:  # noqa: ANN001
        return self.proc.url

    async def stop(self, rank: int) -> None:
        return None

    def pids(self) -> dict[int, int]:
        return {0: self.proc.pid}

    async def dead_ranks(self) -> list[int]:
        return [] if self.proc.alive() else [0]


def test_preemption_drains_pauses_and_redispatches(vllm_shard):
    """(vLLM aborts promptly, so its drain finishes; the forced path, a shard that does not drain
    in time, is test_fleet.py's test_a_shard_that_does_not_drain_is_paused_by_force.)"""
    backend_sleeps = make_backend(EngineBackendConfig(backend="vllm", model="tiny", python="x")).supports_sleep
    assert backend_sleeps is False  # CPU: the capability the scheduler is told

    async def main() -> tuple[dict, list, dict]:
        router = Router(KEY, hold_timeout_s=120)
        client = RemoteInferenceClient(None, {}, KEY, "tiny")
        fleet = ShardFleet(_Running(vllm_shard), router, client, supports_sleep=False,
                           drain_timeout_s=30, drain_before_sleep=True)
        await fleet.start([0])
        params = SP(max_tokens=400, ignore_eos=True, temperature=1.0, logprobs=0)
        jobs = [asyncio.ensure_future(router.generate([5, 6, 7 + i], params)) for i in range(6)]
        while (await client.load([0]))[0]["running"] < 6:
            await asyncio.sleep(0.01)
        pending = [j for j in jobs if not j.done()]
        phases = (await fleet.sleep_partial([0]))[0]
        paused = (await client.is_paused([0]))[0]
        load = (await client.load([0]))[0]
        await asyncio.sleep(0.3)
        # aborted by the preemption and held by the router, not failed (one may have just finished)
        assert sum(not j.done() for j in pending) >= 3, [j.done() for j in pending]
        await fleet.expand([0])  # resume + route again: the aborted requests are re-dispatched
        results = await asyncio.gather(*jobs)
        await fleet.shutdown()
        return phases, results, {"paused": paused, **load}

    phases, results, state = asyncio.run(main())
    assert state["paused"] is True and state["running"] == 0
    assert phases["forced"] is False and phases["abort_ms"] > 0
    for g in results:  # every trajectory completed; none lost to the preemption
        assert len(g.token_ids) == 400 and g.finish_reason == "length" and len(g.logprobs) == 400
    assert not httpx.get(vllm_shard.url + "/is_paused", timeout=10).json()["is_paused"]
