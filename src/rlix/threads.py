"""How often Python hands the GIL between threads, for processes that answer control calls.

A shard server runs its HTTP loop beside the engine thread; a pipeline process runs its control
loop beside the data-plane thread. With CPython's default 5 ms switch interval every GIL
handoff to a waiting loop can cost up to 5 ms, and one control call needs several handoffs
(measured: a preemption's release -> wake took 10-13 ms across such processes on 2 busy cores,
9 ms at 0.5 ms). The busy thread loses a little throughput to more frequent switches.
"""

from __future__ import annotations

import sys

#: seconds; CPython's default is 0.005
CONTROL_SWITCH_INTERVAL_S = 0.0005


def favour_control_latency() -> None:
    """Make GIL handoffs to a waiting thread (an event loop with a control call) prompt."""
    sys.setswitchinterval(CONTROL_SWITCH_INTERVAL_S)
