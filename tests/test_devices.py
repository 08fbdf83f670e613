"""The GPU hand-off check: residue that leaves room for the next holder passes, a real shortage
fails with the GPU, the holder and the bytes named, and a shortfall is measured again first."""

from __future__ import annotations

import asyncio

import pytest

from rlix.devices import DeviceMemory, confirm_release, memory_report, release_shortfall
from rlix.errors import GpuMemoryError

GiB, MiB = 1 << 30, 1 << 20


def _report(reserved: int, free: int | None, total: int | None = 80 * GiB) -> DeviceMemory:
    return DeviceMemory("cuda:0", reserved, 0, free, total if free is not None else None, 0.0)


def test_residue_that_leaves_room_for_the_next_holder_is_no_shortfall() -> None:
    # the case that killed a healthy pipeline: 684 MiB kept, a nearly empty GPU
    assert release_shortfall(_report(684 * MiB, 70 * GiB), holder="the trainer of long-b", gpu="2",
                             need_bytes=4 * GiB) is None
    assert release_shortfall(_report(100 * MiB, 1 * GiB), holder="h", gpu="0", need_bytes=4 * GiB) is None, \
        "a remnant under the slack is never questioned"
    assert release_shortfall(_report(0, None), holder="h", gpu="0", need_bytes=4 * GiB) is None, "CPU"


def test_a_real_shortage_names_the_gpu_the_holder_and_the_bytes() -> None:
    why = release_shortfall(_report(6 * GiB, 2 * GiB), holder="the trainer of long-b", gpu="2", need_bytes=4 * GiB)
    assert why is not None
    for part in ("GPU 2", "the trainer of long-b", "6144 MiB", "2.00 GiB", "80.00 GiB", "needs 4.00 GiB"):
        assert part in why, (part, why)


def test_a_shortfall_is_measured_again_and_fails_only_if_it_lasts() -> None:
    calls = []

    async def lasting() -> DeviceMemory:
        calls.append(1)
        return _report(6 * GiB, 2 * GiB)

    with pytest.raises(GpuMemoryError, match=r"GPU 1: the shard .*measured 3 times"):
        asyncio.run(confirm_release(_report(6 * GiB, 2 * GiB), lasting, holder="the shard", gpu="1",
                                    need_bytes=4 * GiB, retries=2, retry_s=0.0))
    assert len(calls) == 2

    freed_late = iter([_report(6 * GiB, 2 * GiB), _report(700 * MiB, 60 * GiB)])

    async def clears() -> DeviceMemory:
        return next(freed_late)

    out = asyncio.run(confirm_release(_report(6 * GiB, 2 * GiB), clears, holder="h", gpu="1",
                                      need_bytes=4 * GiB, retries=3, retry_s=0.0))
    assert out.device_free == 60 * GiB


def test_no_remeasure_when_the_first_measurement_holds() -> None:
    async def never() -> DeviceMemory:
        raise AssertionError("measured again although the release held")

    report = _report(900 * MiB, 30 * GiB)
    assert asyncio.run(confirm_release(report, never, holder="h", gpu="0", need_bytes=GiB)) is report


def test_memory_report_reads_what_a_holder_sent() -> None:
    row = _report(5, 6).as_dict()
    assert memory_report(row) == _report(5, 6)
    assert memory_report({}).device_free is None  # nothing said: no device
