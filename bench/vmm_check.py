"""Self-check of the CUDA virtual memory buffers (runner/vmm.py) on one GPU, step by step.

Each step runs even when one before it failed (where it can), and the script ends by printing
one JSON line: every step with "pass" or "fail: <why>", and the figures measured on the way
(bytes freed by an unmap, bytes taken back by a remap, a wake's time and captures).

    PYTHONPATH=src python bench/vmm_check.py            # buffer steps, then an engine
    PYTHONPATH=src python bench/vmm_check.py --no-engine
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import traceback
from collections.abc import Callable

import torch

from rlix.inference.engine.runner import vmm

MiB = 1 << 20


class Checks:
    """Named steps, each passed or failed with its reason; figures beside them."""

    def __init__(self) -> None:
        self.steps: dict[str, str] = {}
        self.figures: dict[str, object] = {}

    def run(self, name: str, fn: Callable[[], object]) -> object:
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a failed step is a result, the next ones run
            self.steps[name] = f"fail: {type(exc).__name__}: {exc}"[:400]
            tracebacks = self.figures.setdefault("tracebacks", {})
            assert isinstance(tracebacks, dict)
            tracebacks[name] = traceback.format_exc(limit=4)[-800:]
            return None
        self.steps[name] = "pass"
        return out


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def check(condition: bool, why: str) -> None:
    if not condition:
        raise AssertionError(why)


def buffer_steps(c: Checks, size: int) -> None:
    buf = c.run("construct", lambda: vmm.VirtualBuffer(size, "cuda"))
    if buf is None:
        return
    c.figures.update(address=hex(buf.address), nbytes=buf.nbytes)

    def views() -> torch.Tensor:
        a = buf.tensor(torch.float32, (size // 4,))
        b = buf.tensor(torch.uint8, (size,))
        check(a.data_ptr() == buf.address == b.data_ptr(), "data_ptr is not the reserved address")
        check(a.device == torch.device("cuda", torch.cuda.current_device()), f"device {a.device}")
        a.fill_(1.0)
        check(bool((b.view(torch.float32) == 1.0).all()), "two views do not share the memory")
        check(vmm.mapped_bytes("cuda") >= buf.nbytes, "mapped_bytes does not count the buffer")
        return a

    a = c.run("tensor_is_a_view", views)

    def unmap() -> None:
        before = free_bytes()
        buf.unmap()
        freed = free_bytes() - before
        c.figures["unmap_freed_bytes"] = freed
        check(not buf.mapped and freed >= size, f"unmap freed {freed} of {size}")

    c.run("unmap_frees_device_memory", unmap)

    def remap() -> None:
        before = free_bytes()
        buf.remap()
        taken = before - free_bytes()
        c.figures["remap_taken_bytes"] = taken
        check(buf.mapped and taken >= size, f"remap took {taken} of {size}")

    c.run("remap_takes_it_back", remap)

    def same_address() -> None:
        t = a if a is not None else buf.tensor(torch.float32, (size // 4,))
        check(t.data_ptr() == buf.address, "address moved")
        pattern = torch.arange(size // 4, device="cuda", dtype=torch.float32)
        t.copy_(pattern)
        check(torch.equal(t, pattern), "pattern written after remap does not read back")
        buf.unmap()
        buf.remap()
        t.copy_(pattern * 2)
        check(torch.equal(t, pattern * 2), "pattern after a second unmap/remap does not read back")

    c.run("rewritten_after_remap_reads_back", same_address)

    def graph() -> None:
        x = buf.tensor(torch.float32, (1024,))
        w = buf.tensor(torch.float32, (2048,))[1024:]
        x.copy_(torch.arange(1024, device="cuda", dtype=torch.float32))
        w.fill_(1.0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x * 2 + w
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2 + w
        g.replay()
        torch.cuda.synchronize()
        check(torch.equal(y, torch.arange(1024, device="cuda", dtype=torch.float32) * 2 + 1), "first replay")
        buf.unmap()
        buf.remap()
        x.copy_(torch.arange(1024, device="cuda", dtype=torch.float32) * -1)
        w.fill_(3.0)
        g.replay()
        torch.cuda.synchronize()
        check(torch.equal(y, torch.arange(1024, device="cuda", dtype=torch.float32) * -2 + 3),
              "replay after unmap/remap")

    c.run("graph_replays_after_unmap_remap", graph)

    def close() -> None:
        before = free_bytes()
        buf.close()
        check(buf.closed and not buf.mapped, "not closed")
        check(free_bytes() - before >= size, "close did not free the memory")

    c.run("close_frees", close)
    del a

    def lifetime() -> None:
        before = free_bytes()
        other = vmm.VirtualBuffer(size, "cuda")
        t = other.tensor(torch.float16, (size // 2,))
        del other
        gc.collect()
        t.fill_(2.0)
        check(float(t[-1]) == 2.0, "the tensor lost its buffer")
        del t
        gc.collect()
        check(free_bytes() >= before - 2 * MiB, "the buffer outlived its last tensor")

    c.run("buffer_lives_with_its_tensors", lifetime)

    def typed_error() -> None:
        total = torch.cuda.mem_get_info()[1]
        try:
            vmm.VirtualBuffer(2 * total, "cuda")
        except vmm.VirtualMemoryError as exc:
            c.figures["oom_error"] = str(exc)
            check(exc.call in ("cuMemCreate", "cuMemAddressReserve") and exc.code not in (None, 0),
                  f"call {exc.call} code {exc.code}")
            return
        raise AssertionError("a buffer of twice the device's memory was created")

    c.run("failure_is_a_typed_error", typed_error)


def engine_steps(c: Checks, model: str) -> None:
    from rlix.inference.engine.api import SamplingParams
    from rlix.inference.engine.engine import TorchEngine
    from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync
    from rlix.weights.buckets import named_weights

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = c.run("engine_loads", lambda: TorchEngine.from_pretrained(
        model, device="cuda", max_num_seqs=8, max_model_len=512))
    if engine is None:
        return

    async def generate(tag: str) -> list[int]:
        last = None
        async for last in engine.generate(tag, list(range(5, 29)), params):
            pass
        return list(last.token_ids)

    async def reload(cache: BucketCache, version: int) -> None:
        await engine.wake_up(["weights"])
        sync = WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(engine, device="cuda"))}, "shm")
        check(not (await sync.sync(version, [0])).failed, "sync failed")
        await engine.wake_up(["kv_cache"])

    async def main() -> None:
        state = {n: t.detach().cpu() for n, t in named_weights(engine.model).items()}
        base = await generate("base")
        with BucketCache.for_model(state) as cache:
            cache.build_latest(1, state)
            await engine.sleep(2)
            await reload(cache, 1)
            check(engine._weights.in_virtual_store(), "weights not in a virtual store after the reload")
            check(await generate("first") == base, "output changed after the first reload")
            captures = engine.sleep_report()["graph_captures"]
            for level, version in ((2, 2), (1, None)):
                awake = free_bytes()
                need = engine.weight_bytes() + engine.kv_cache_bytes()
                await engine.sleep(level)
                report = engine.sleep_report()
                c.figures[f"level{level}_freed_bytes"] = free_bytes() - awake
                c.figures[f"level{level}_resident_bytes"] = report["resident_bytes"]
                check(report["graphs_kept"], f"level {level}: graphs not kept")
                check(report["vmm_mapped_bytes"] == 0, f"level {level}: still mapped")
                check(free_bytes() - awake >= need, f"level {level}: freed less than weights + KV")
                t0 = time.perf_counter()
                if version is not None:
                    cache.build_latest(version, state)
                    await reload(cache, version)
                else:
                    await engine.wake_up()
                c.figures[f"level{level}_wake_s"] = round(time.perf_counter() - t0, 4)
                check(await generate(f"l{level}") == base, f"level {level}: output changed")
                grown = engine.sleep_report()["graph_captures"] - captures
                c.figures[f"level{level}_captures_after_wake"] = grown
                check(grown == 0, f"level {level}: {grown} graphs captured again")

    try:
        c.run("engine_sleep_wake_keeps_graphs", lambda: asyncio.run(main()))
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--model", default="small")
    ap.add_argument("--no-engine", action="store_true")
    args = ap.parse_args()
    c = Checks()
    c.run("available", lambda: check(vmm.available("cuda"), "vmm.available('cuda') is False"))
    c.figures["torch"] = torch.__version__
    if torch.cuda.is_available():
        c.figures["device"] = torch.cuda.get_device_name()
    if c.steps["available"] == "pass":
        buffer_steps(c, args.size_mib * MiB)
        if not args.no_engine:
            engine_steps(c, args.model)
    failed = [k for k, v in c.steps.items() if v != "pass"]
    print(json.dumps({"bench": "vmm_check", "passed": not failed, "failed": failed,
                      "steps": c.steps, **c.figures}))


if __name__ == "__main__":
    main()
