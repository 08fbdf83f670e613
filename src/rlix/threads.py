"""How often Python hands the GIL between threads, for processes that answer control calls.

A shard server runs its HTTP loop beside the engine thread; a pipeline process runs its control
loop beside the data-plane thread. With CPython's default 5 ms switch interval every GIL
handoff to a waiting loop can cost up to 5 ms, and one control call needs several handoffs
(measured: a preemption's release -> wake took 10-13 ms across such processes on 2 busy cores,
9 ms at 0.5 ms). The busy thread loses a little throughput to more frequent switches.
"""

from __future__ import annotations

import os
import sys
import threading

#: seconds; CPython's default is 0.005
CONTROL_SWITCH_INTERVAL_S = 0.0005


def favour_control_latency() -> None:
    """Make GIL handoffs to a waiting thread (an event loop with a control call) prompt."""
    sys.setswitchinterval(CONTROL_SWITCH_INTERVAL_S)


#: how much lower than control threads compute threads on CPU devices run (nice steps)
COMPUTE_NICE_STEPS = 10


def yield_cores_to_control(device: str = "cpu") -> bool:
    """Lower this thread's CPU priority when it computes on the CPU (fake GPUs: the compute
    shares the cores with every control thread). A control call then runs when it arrives, not
    after the compute's time slice. Only ever lowers (no privilege needed); False if not done."""
    if str(device).split(":")[0] != "cpu" or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + COMPUTE_NICE_STEPS))
    except OSError:
        return False
    return True
