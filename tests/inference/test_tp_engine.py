"""The embedded engine split over two ranks (runner/tp/): on
the CPU its second rank is a process over gloo. It generates what the one-rank engine generates
(concurrent rows that finish and move, forked samples, host-sampled rows), sleeps and wakes on
every rank, takes in-place and full (level-2) weight updates on every rank, refuses a bad one on
every rank, answers the weight audit with the whole model's checksums, and fails (not hangs)
when a rank is killed; every rank's process ends with the engine, or with rank 0's process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rlix.devices import DeviceMemory
from rlix.errors import ConfigError, EngineStateError, WeightUpdateError
from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner.tp import group as tp_group
from rlix.inference.engine.runner.tp.group import Reply, read_message
from rlix.inference.engine.runner.tp.runner import tightest
from rlix.procguard import pid_alive
from rlix.weights import BucketCache, WeightSync
from rlix.weights.buckets import tensor_checksums
from rlix.weights.http_endpoint import http_endpoints
from kit import AUTH, KEY, shard_processes
from serve_kit import start_serve

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 42, 8], [11, 2, 300], [45, 46, 47, 48, 49], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
#: different lengths: rows finish at different steps and the rows after them move up
LENGTHS = [5, 16, 9, 12]
GONE_S = 20.0


def _engine(path, tp: int) -> TorchEngine:
    return TorchEngine.from_pretrained(path, dtype="float32", max_num_seqs=8, tensor_parallel_size=tp)


async def _one(engine: TorchEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    by_index: dict[int, list[int]] = {}
    async for out in engine.generate(rid, prompt, params):
        by_index[out.index] = out.token_ids
    return [by_index[i] for i in sorted(by_index)]


async def _batch(engine: TorchEngine, tag: str = "") -> list[list[list[int]]]:
    """Every prompt at once, greedy, each with its own length; one with 2 samples (a fork), one
    with top logprobs (sampled on the host, not in the plain launch)."""
    calls = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                n=2 if i == 1 else 1, top_logprobs=3 if i == 2 else 0)
        calls.append(_one(engine, f"{tag}r{i}", prompt, params))
    return list(await asyncio.gather(*calls))


def _gone(pids: list[int], within_s: float = GONE_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    engine = _engine(tiny_model_dir, 1)
    yield engine
    engine.close()


@contextlib.contextmanager
def _two_ranks(path) -> Iterator[TorchEngine]:
    engine = _engine(path, 2)
    pids = engine._runner.group.pids
    try:
        yield engine
    finally:
        engine.close()
    assert _gone(pids), f"tensor parallel workers {pids} outlived the engine"


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Two ranks shared by the tests that leave them serving the checkpoint's weights."""
    with _two_ranks(tiny_model_dir) as engine:
        yield engine


@pytest.fixture()
def doomed(tiny_model_dir):
    """Two ranks of a test's own (it kills one)."""
    with _two_ranks(tiny_model_dir) as engine:
        yield engine


def _changed(path) -> dict[str, torch.Tensor]:
    """New full values for split and replicated tensors, as a trainer sends them."""
    full = load_file(str(path / "model.safetensors"))
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.0.self_attn.v_proj.bias", "model.norm.weight"]
    gen = torch.Generator().manual_seed(3)
    return {n: full[n] + 0.2 * torch.randn(full[n].shape, generator=gen) for n in names}


def test_two_ranks_generate_what_one_rank_does(single, pair):
    one, two = asyncio.run(_batch(single)), asyncio.run(_batch(pair))
    assert two == one
    assert [len(samples) for samples in two] == [1, 2, 1, 1]
    assert [len(samples[0]) for samples in two] == LENGTHS


def test_sleep_wake_and_weight_updates_reach_every_rank(single, pair, tiny_model_dir):
    async def main():
        base = await _batch(pair)
        await pair.sleep(1)
        assert pair.is_sleeping()
        await pair.wake_up()
        after_wake = await _batch(pair, "w")
        changed = _changed(tiny_model_dir)
        for engine in (single, pair):  # an in-place update of a few tensors
            await engine.start_weight_update(1, allow_partial=True)
            await engine.update_weights(changed)
            assert await engine.finish_weight_update() == 1
        updated = [await _batch(single, "u"), await _batch(pair, "u")]
        sums = [await single.weight_checksums(), await pair.weight_checksums()]
        await pair.sleep(2)  # weights dropped on every rank: a full reload brings them back
        await pair.wake_up()
        await pair.start_weight_update(2)
        await pair.update_weights(load_file(str(tiny_model_dir / "model.safetensors")))
        assert await pair.finish_weight_update() == 2
        reloaded = await _batch(pair, "l")
        for engine in (single,):  # leave the module's engine as it was
            await engine.start_weight_update(2)
            await engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")))
            await engine.finish_weight_update()
        return base, after_wake, updated, sums, reloaded

    base, after_wake, (single_updated, pair_updated), (single_sums, pair_sums), reloaded = asyncio.run(main())
    assert after_wake == base
    assert pair_updated == single_updated and pair_updated != base  # every rank took its slices
    assert pair_sums == single_sums  # the audit sees the whole model, gathered from both ranks
    assert reloaded == base


def test_a_refused_update_leaves_every_rank_serving_the_old_weights(pair, tiny_model_dir):
    async def main():
        base = await _batch(pair)
        sums = await pair.weight_checksums()
        await pair.start_weight_update(1)
        bad = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
        with pytest.raises(WeightUpdateError, match="shape"):
            await pair.update_weights(bad)
        await pair.start_weight_update(1)  # incomplete: refused at finish, on every rank
        await pair.update_weights(_changed(tiny_model_dir))
        with pytest.raises(WeightUpdateError, match="incomplete"):
            await pair.finish_weight_update()
        return base, sums, await _batch(pair, "a"), await pair.weight_checksums()

    version = pair.weight_version
    base, sums, after, sums_after = asyncio.run(main())
    assert after == base and sums_after == sums and pair.weight_version == version


def test_the_specs_are_the_whole_model(single, pair):
    assert pair.weight_specs() == single.weight_specs()


def test_a_killed_rank_fails_the_engine_instead_of_hanging(doomed):
    (worker,) = doomed._runner.group.pids
    os.kill(worker, signal.SIGKILL)
    assert _gone([worker])

    async def main():
        started = time.monotonic()
        with pytest.raises(EngineStateError, match=rf"rank 1 \(pid {worker}\)"):
            await asyncio.wait_for(_batch(doomed), 60)
        return time.monotonic() - started

    assert asyncio.run(main()) < 30
    assert f"rank 1 (pid {worker})" in (doomed.failure() or "")  # the server's /health answers 503


@pytest.mark.parametrize("size, named", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_a_size_that_does_not_divide_the_model_is_refused_before_starting(tiny_model_dir, size, named):
    before = set(_children())
    with pytest.raises(ConfigError, match=f"tensor parallel size {size} does not divide .*{named}"):
        _engine(tiny_model_dir, size)
    assert set(_children()) == before


def _children(pid: int | None = None) -> list[int]:
    """The child processes of `pid` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


_RANK0 = """
import sys, time
from rlix.inference.engine.engine import TorchEngine
engine = TorchEngine.from_pretrained(sys.argv[1], dtype="float32", max_num_seqs=2, tensor_parallel_size=2)
print(*engine._runner.group.pids, flush=True)
time.sleep(600)
"""


def test_the_workers_end_when_rank_0_is_killed(tiny_model_dir):
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout is not None
        workers = [int(p) for p in rank0.stdout.readline().split()]
        assert len(workers) == 1 and pid_alive(workers[0])
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(10)
        assert _gone(workers), f"worker {workers} outlived its SIGKILLed rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()


@pytest.mark.slow
def test_rlix_serve_splits_the_model_and_health_fails_with_a_rank(tiny_model_dir):
    """`rlix serve --tensor-parallel-size 2`: the same greedy completion as one rank over HTTP;
    its worker killed by PID turns /health to 503 naming it (the fleet replaces such a shard);
    the server SIGKILLed leaves no worker behind."""
    proc, base = start_serve("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "4",
                             "--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        body = {"model": "tiny", "prompt": [5, 17, 99, 3], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        with TorchEngine.from_pretrained(tiny_model_dir, dtype="float32", max_num_seqs=4) as one:
            want = asyncio.run(_one(one, "x", [5, 17, 99, 3], SamplingParams(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True)))[0]
        assert got.json()["choices"][0]["token_ids"] == want
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + GONE_S
        while (health := httpx.get(f"{base}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 with a rank gone"
            time.sleep(0.2)
        assert health.status_code == 503 and f"rank 1 (pid {worker})" in health.text
    finally:
        workers = _children(proc.pid)
        proc.kill()  # SIGKILL by its PID: nothing of it may end its workers but their own watch
        proc.wait(10)
    assert _gone(workers), f"workers {workers} outlived the SIGKILLed server"


def test_the_tightest_gpu_of_a_group_is_the_one_reported():
    gib = 2**30
    reports = [DeviceMemory("cuda:0", 1 * gib, 0, 60 * gib, 80 * gib, 0.0),
               DeviceMemory("cuda:1", 9 * gib, 0, 12 * gib, 80 * gib, 0.0),
               DeviceMemory("cuda:2", 2 * gib, 0, 70 * gib, 80 * gib, 0.0)]
    assert tightest(reports).device == "cuda:1"


def test_the_memory_a_sleep_reports_is_measured_on_every_rank(doomed):
    """The hand-off check reads one report: the tightest GPU of the group (on the CPU each rank
    reports its host device, no device memory)."""
    report = doomed.device_memory()
    assert report.device == "cpu" and report.device_free is None
    (worker,) = doomed._runner.group.pids
    os.kill(worker, signal.SIGKILL)
    assert _gone([worker])
    with pytest.raises(EngineStateError, match="rank 1"):  # no rank, no measurement: never a stale one
        doomed.device_memory()


def test_a_next_turn_reuses_the_kept_rows_on_every_rank(single, pair):
    """The prefix cache with two ranks: each keeps its heads of a finished row, and the next
    turn (the conversation so far and more) starts from them on both, as on one rank."""
    first = [(7 * i + 3) % 300 for i in range(24)]

    async def turns(engine: TorchEngine, tag: str) -> tuple[list[int], list[int]]:
        (answer,) = await _one(engine, f"{tag}1", first, GREEDY)
        (second,) = await _one(engine, f"{tag}2", first + answer + [11, 12, 13], GREEDY)
        return answer, second

    before_single, before_pair = single.prefix_hit_tokens, pair.prefix_hit_tokens
    assert asyncio.run(turns(pair, "p")) == asyncio.run(turns(single, "s"))
    assert pair.prefix_hit_tokens - before_pair == single.prefix_hit_tokens - before_single > 0


_NOISY = """
import os
from rlix.inference.engine.runner.tp import worker as tp_worker
from rlix.inference.engine.runner.tp.group import Reply, write_message
replies = tp_worker._replies_only()
os.write(1, b"NCCL version 2.28.9+cuda13.0\\n")  # as a C library writes to file descriptor 1
print("a print")
write_message(replies, Reply(True, 5))
"""


def test_what_a_worker_writes_to_stdout_never_lands_among_its_replies():
    done = subprocess.run([sys.executable, "-c", _NOISY], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert read_message(io.BytesIO(done.stdout)) == Reply(True, 5)
    assert b"NCCL version" in done.stderr and b"a print" in done.stderr


def test_a_split_shard_server_syncs_and_passes_the_audit(tiny_model_dir):
    """A shard server running the engine over two ranks (`--tensor-parallel-size 2`, here on the
    CPU) beside a one-rank server: a version synced from the trainer's cache over shared memory,
    bucket by bucket, reaches both ranks (the same greedy tokens as the one-rank server, the
    audit's checksums equal to the trainer's); after a level-2 sleep a one-call wake and sync
    reloads every rank."""
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    new = {n: (t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype)).contiguous() for n, t in state.items()}
    want = tensor_checksums(new)

    async def greedy(http: httpx.AsyncClient, url: str) -> list[int]:
        r = await http.post(f"{url}/inference/v1/generate", json={
            "token_ids": PROMPTS[0], "sampling_params": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    with shard_processes(tiny_model_dir, 1) as (one,), \
            shard_processes(tiny_model_dir, 1, extra_args=("--tensor-parallel-size", "2")) as (two,):
        urls = {0: one.url, 1: two.url}

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
                assert await greedy(http, urls[0]) == await greedy(http, urls[1])
                with BucketCache.for_model(new, bucket_bytes=32 << 10) as cache:
                    cache.build_latest(1, new)
                    await WeightSync(cache, http_endpoints(urls, KEY), "shm", one_call=False).sync(1, [0, 1])
                    synced = [await greedy(http, urls[r]) for r in (0, 1)]
                    sums = [(await http.get(f"{urls[r]}/weight_checksums")).json()["checksums"] for r in (0, 1)]
                    assert sums[1] == sums[0] and {n: want[n] for n in sums[1]} == sums[1]  # every tensor, whole
                    assert synced[1] == synced[0]
                    (await http.post(f"{urls[1]}/sleep", params={"level": 2})).raise_for_status()
                    cache.build_latest(2, new)
                    await WeightSync(cache, http_endpoints({1: urls[1]}, KEY), "shm").sync(2, [1], wake=[1])
                    assert await greedy(http, urls[1]) == synced[0]
                    assert (await http.get(f"{urls[1]}/weight_checksums")).json()["checksums"] == sums[0]

        asyncio.run(main())


def test_a_rank_that_never_joins_fails_the_start_naming_it(tiny_model_dir, monkeypatch):
    """A worker that dies before the group forms (here: a module that exits at once) fails the
    engine's start within the join timeout, with its exit code; nothing is left running."""
    monkeypatch.setattr(tp_group, "JOIN_TIMEOUT_S", 5.0)
    monkeypatch.setattr(tp_group, "WORKER_MODULE", "rlix.no_such_module")
    before = set(_children())
    started = time.monotonic()
    with pytest.raises(EngineStateError, match=r"tensor parallel rank 1 \(pid \d+\) exited with code 1"):
        TorchEngine.from_pretrained(tiny_model_dir, dtype="float32", max_num_seqs=2, tensor_parallel_size=2)
    assert time.monotonic() - started < 30
    assert set(_children()) == before
