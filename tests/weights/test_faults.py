"""Failed, partial and mismatched updates are refused and the old weights keep serving."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import subprocess
import sys
import textwrap
import threading
from multiprocessing.connection import Listener

import pytest
import torch

from rlix.errors import (WeightChecksumError, WeightLayoutError, WeightSyncError,
                         WeightTransferError, WeightUpdateError)
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync
from rlix.weights.wire import SHM_DIR
from rlix.weights.transport.local import LocalSender, LocalTransport

from model_engine import ModelEngine, load_into_model


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128, 64, generator=gen) for i in range(6)} | {
        "ids": torch.arange(300, dtype=torch.int64)}


def snapshot(engine: ModelEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.served().items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Spy(ModelEngine):
    """Counts the engine calls; can stall at the k-th update until released."""

    def __init__(self, weights, stall_at: int = 0) -> None:  # type: ignore[no-untyped-def]
        super().__init__(weights)
        self.calls: list[str] = []
        self.stall_at, self.reached, self.release = stall_at, threading.Event(), threading.Event()

    async def start_weight_update(self, version: int) -> None:
        self.calls.append("start")
        await super().start_weight_update(version)

    async def update_weights(self, named_tensors) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("update")
        if self.calls.count("update") == self.stall_at:
            self.reached.set()
            await asyncio.to_thread(self.release.wait, 60)
        await super().update_weights(named_tensors)


SENDER = textwrap.dedent("""
    import asyncio, sys, torch
    from multiprocessing.connection import Client
    from rlix.weights import BucketCache, WeightSync
    sys.path.insert(0, HERE)
    from pipe_shard import ConnectionEndpoint
    path, port = sys.argv[1], int(sys.argv[2])
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    sd = torch.load(path)
    cache = BucketCache.for_model(sd, bucket_bytes=16 << 10, host="shm")
    cache.build_latest(1, sd)
    endpoint = ConnectionEndpoint(Client(("127.0.0.1", port), authkey=authkey), "receiver")
    asyncio.run(WeightSync(cache, {0: endpoint}, "shm").sync(1, [0]))
    print("sender finished", flush=True)
""").replace("HERE", repr(os.path.dirname(os.path.abspath(__file__))))


def test_sender_killed_mid_transfer_aborts_the_update_and_keeps_old_weights(tmp_path):
    from pipe_shard import serve_connection

    torch.save(state(1), tmp_path / "new.pt")
    engine = Spy(state(0), stall_at=3)
    before = snapshot(engine)
    receiver = ShardUpdater(engine)
    authkey = os.urandom(16)
    outcome: dict[str, BaseException | None] = {}
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        def serve() -> None:
            conn = listener.accept()
            try:
                serve_connection(conn, receiver)
                outcome["error"] = None
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        proc = subprocess.Popen([sys.executable, "-c", SENDER, str(tmp_path / "new.pt"),
                                 str(listener.address[1])], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            proc.stdin.write(authkey.hex().encode() + b"\n")
            proc.stdin.close()
            assert engine.reached.wait(60), proc.stderr.read().decode()
            proc.kill()  # the trainer dies after some buckets
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for path in glob.glob(os.path.join(SHM_DIR, f"rlix-*-{proc.pid}-*")):
                os.unlink(path)  # a killed process cannot clean up its segments
            engine.release.set()
        thread.join(30)
    assert not thread.is_alive()
    err = outcome["error"]
    assert isinstance(err, WeightTransferError)
    got, total = map(int, re.search(r"after (\d+) of (\d+) buckets", str(err)).groups())
    assert "disconnected during the update to version 1" in str(err) and 0 < got < total
    assert engine.aborts and "disconnected" in engine.aborts[0]
    assert engine.weight_version == 0 and equal(engine.served(), before)
    assert receiver.updating is None and "disconnected" in str(receiver.last_error)


@pytest.mark.parametrize("change, words", [
    (lambda sd: sd.update(w0=torch.zeros(128, 65)), "w0: shape"),
    (lambda sd: sd.update(w1=sd["w1"].half()), "w1: dtype"),
    (lambda sd: sd.update(extra=torch.zeros(3)), "extra: not a tensor of the receiving model"),
    (lambda sd: sd.pop("ids"), "ids: the model has it but the layout does not send it"),
])
def test_mismatched_layout_is_refused_before_any_bytes(change, words):
    engine = Spy(state(0))
    before = snapshot(engine)
    sd = state(1)
    change(sd)
    with BucketCache.for_model(sd, bucket_bytes=16 << 10) as cache:
        cache.build_latest(1, sd)
        ep = InProcessEndpoint(ShardUpdater(engine))
        with pytest.raises(WeightSyncError, match="layout refused") as err:
            asyncio.run(WeightSync(cache, {0: ep}, "local").sync(1, [0]))
    assert words in str(err.value) and err.value.failed.keys() == {0} and err.value.succeeded == []
    assert engine.calls == []  # refused at init: no update was even started
    assert engine.weight_version == 0 and equal(engine.served(), before)


class NoSpecs:
    """An engine that does not tell its shapes up front: its own update_weights must refuse."""

    def __init__(self, inner: ModelEngine) -> None:
        self.inner = inner

    def weight_specs(self):  # type: ignore[no-untyped-def]
        return None

    def weight_destination(self, name):  # type: ignore[no-untyped-def]
        return None

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)


def test_without_specs_the_engine_refuses_and_the_update_is_aborted():
    engine = ModelEngine(state(0))
    before = snapshot(engine)
    sd = state(1)
    sd["w3"] = torch.zeros(64, 128)
    with BucketCache.for_model(sd, bucket_bytes=16 << 10) as cache:
        cache.build_latest(4, sd)
        with pytest.raises(WeightSyncError, match="w3: got torch.float32 \\(64, 128\\)"):
            asyncio.run(WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(NoSpecs(engine)))},
                                   "local").sync(4, [0]))
    assert engine.weight_version == 0 and equal(engine.served(), before)


class Corrupting(LocalTransport):
    """Flips one bit of bucket `index` in flight (on a copy: the cache stays intact)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def sender(self) -> LocalSender:
        index = self.index

        class Sender(LocalSender):
            def send(self, version, i, buffer, checksum=None):  # type: ignore[no-untyped-def]
                if i == index:
                    buffer = buffer.clone()
                    buffer[buffer.numel() // 2] ^= 1
                return super().send(version, i, buffer, checksum)
        return Sender()


def test_checksum_mismatch_is_rejected_when_verifying():
    engine = ModelEngine(state(0))
    before = snapshot(engine)
    with BucketCache.for_model(state(1), bucket_bytes=16 << 10) as cache:
        cache.build_latest(1, state(1))
        ep = InProcessEndpoint(ShardUpdater(engine))
        with pytest.raises(WeightSyncError, match="bucket 2 checksum .* bytes corrupted") as err:
            asyncio.run(WeightSync(cache, {0: ep}, Corrupting(2), verify=True).sync(1, [0]))
        assert isinstance(err.value, WeightUpdateError)
        assert engine.weight_version == 0 and equal(engine.served(), before)
        asyncio.run(WeightSync(cache, {0: ep}, "local", verify=True).sync(1, [0]))  # clean retry
        assert engine.weight_version == 1 and equal(engine.served(), state(1))
        # the shard-level error is typed
        rec = ShardUpdater(ModelEngine(state(0)))
        rec.init_transfer({"layout": cache.layout.to_json(), "transport": "local", "verify": True})
        asyncio.run(rec.start(1, cache.layout.layout_id, {}))
        bad = cache.buckets(1)[0].clone()
        bad[0] ^= 1
        with pytest.raises(WeightChecksumError):
            asyncio.run(rec.bucket({"version": 1, "bucket": 0, "nbytes": bad.numel(),
                                    "checksum": cache.checksums(1)[0], "tensor": bad}))
        assert rec.updating is None and rec.engine.aborts


def test_receiver_refuses_wrong_version_layout_duplicates_and_incomplete_updates():
    engine = ModelEngine(state(0))
    before = snapshot(engine)
    with BucketCache.for_model(state(1), bucket_bytes=16 << 10) as cache:
        cache.build_latest(1, state(1))
        buckets = cache.buckets(1)
        rec = ShardUpdater(engine)
        rec.init_transfer({"layout": cache.layout.to_json(), "transport": "local"})
        lid = cache.layout.layout_id

        def msg(i: int, version: int = 1) -> dict:  # type: ignore[type-arg]
            return {"version": version, "bucket": i, "nbytes": buckets[i].numel(), "tensor": buckets[i]}

        async def scenario(steps) -> BaseException:  # type: ignore[no-untyped-def]
            try:
                await rec.start(1, lid, {})
                for step in steps:
                    await step()
            except WeightUpdateError as exc:
                return exc
            raise AssertionError("not refused")

        cases = [
            ([lambda: rec.bucket(msg(0, version=2))], WeightUpdateError, "version 2 arrived"),
            ([lambda: rec.bucket(msg(0)), lambda: rec.bucket(msg(0))], WeightTransferError, "twice"),
            ([lambda: rec.bucket(msg(0)), lambda: rec.finish(1)], WeightTransferError, "incomplete"),
            ([lambda: rec.finish(3)], WeightUpdateError, "finish names version 3"),
        ]
        for steps, cls, words in cases:
            err = asyncio.run(scenario(steps))
            assert isinstance(err, cls) and words in str(err), err
            assert rec.updating is None and engine.weight_version == 0
        with pytest.raises(WeightLayoutError, match="initialised with"):
            asyncio.run(rec.start(1, "0000", {}))
    assert engine.aborts and engine.weight_version == 0 and equal(engine.served(), before)


def test_load_into_model_copies_in_place_after_checking_everything():
    model = torch.nn.Linear(4, 3)
    weight = model.weight
    ptr = weight.data_ptr()
    load_into_model(model, {"weight": torch.ones(3, 4), "bias": torch.zeros(3)})
    assert model.weight is weight and weight.data_ptr() == ptr and torch.equal(weight, torch.ones(3, 4))
    with pytest.raises(WeightUpdateError, match="bias: got"):
        load_into_model(model, {"weight": torch.zeros(3, 4), "bias": torch.zeros(4)})
    assert torch.equal(model.weight, torch.ones(3, 4))  # nothing copied: checked first
