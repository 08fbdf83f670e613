"""Thread priorities for compute on CPU devices (rlix.threads)."""

from __future__ import annotations

import os
import threading

from rlix.threads import COMPUTE_NICE_STEPS, yield_cores_to_control


def _in_thread(device: str) -> tuple[bool, int, int]:
    out: dict[str, object] = {}

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        done = yield_cores_to_control(device)
        out["r"] = (done, before, os.getpriority(os.PRIO_PROCESS, tid))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["r"]  # type: ignore[return-value]


def test_a_cpu_compute_thread_lowers_only_its_own_priority():
    process_before = os.getpriority(os.PRIO_PROCESS, 0)
    done, before, after = _in_thread("cpu")
    assert done and after == min(19, before + COMPUTE_NICE_STEPS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == process_before  # the main thread is untouched


def test_a_gpu_compute_thread_keeps_its_priority():
    done, before, after = _in_thread("cuda:0")
    assert not done and after == before
