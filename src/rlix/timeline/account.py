"""The GPU-time account of a run: every GPU-second of [start, end] on every GPU, once, by
pipeline and category (`model.HELD`), plus the seconds nobody held a GPU (idle, lost)."""

from __future__ import annotations

import math
from typing import Any

from rlix.timeline.model import FREE, HELD, Timeline

#: how the account's categories are shown
LABELS = {"generate": "generate", "train": "train", "sync": "sync", "switch": "sleep/wake",
          "waiting": "waiting", "idle": "idle", "lost": "lost"}


def gpu_account(tl: Timeline, digits: int | None = None) -> dict[str, Any]:
    """Seconds per pipeline and category, from the same parts the trace draws; the pipelines'
    `held` plus `idle_s` and `lost_s` add up to `gpu_s` = GPUs x span (to float rounding,
    or to `digits` when rounded)."""
    held: dict[str, dict[str, list[float]]] = {p: {c: [] for c in HELD} for p in tl.pipelines}
    free: dict[str, list[float]] = {c: [] for c in FREE}
    for holdings in tl.holdings.values():
        for h in holdings:
            for part in h.parts:
                d = part.end - part.start
                if h.pipeline is None:
                    free[part.category].append(d)
                else:
                    held[h.pipeline][part.category].append(d)

    def r(x: float) -> float:
        return round(x, digits) if digits is not None else x

    pipelines = {}
    for p, cats in held.items():
        row = {c: r(math.fsum(v)) for c, v in cats.items()}
        row["held"] = r(math.fsum(d for v in cats.values() for d in v))
        pipelines[p] = row
    return {"gpus": len(tl.gpus), "span_s": r(tl.span_s), "gpu_s": r(len(tl.gpus) * tl.span_s),
            "idle_s": r(math.fsum(free["idle"])), "lost_s": r(math.fsum(free["lost"])),
            "pipelines": pipelines, "role_changes": len(tl.changes)}


def account_lines(account: dict[str, Any]) -> list[str]:
    """The account as a small table (seconds, and each pipeline's share of the GPU-seconds)."""
    gpu_s = account["gpu_s"] or 1.0
    head = ("", "held", "share", *(LABELS[c] for c in HELD))
    rows = [head]
    for p, row in account["pipelines"].items():
        rows.append((p, f"{row['held']:.1f}", f"{row['held'] / gpu_s:.0%}",
                     *(f"{row[c]:.1f}" for c in HELD)))
    for c in FREE:
        if c == "idle" or account[f"{c}_s"]:
            rows.append((f"({LABELS[c]})", f"{account[f'{c}_s']:.1f}", f"{account[f'{c}_s'] / gpu_s:.0%}",
                         *("" for _ in HELD)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"GPU time (s) over {account['gpus']} GPU(s) x {account['span_s']:.1f} s = "
             f"{account['gpu_s']:.1f} GPU-s:"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not account.get("role_changes"):
        lines.append("  (no GPU role changes: without the scheduler, e.g. standalone, who held which "
                     "GPU is not known)")
    return lines
