"""A timeline as a PNG Gantt chart: GPUs as rows (grouped by node), pipelines as colours,
roles as shades (train dark, generate light), time a GPU was held but not computing hatched
(sleep/wake, sync, waiting); below, one row per pipeline with its steps' phases and the weight
versions it published."""

from __future__ import annotations

from pathlib import Path

from rlix.timeline.model import PHASE_CATEGORY, Timeline

HATCHES = {"switch": "////", "sync": "xxxx", "waiting": "...."}
LEGEND = {"switch": "sleep/wake: shard start, wake, sleep; trainer reload, offload",
          "sync": "sync: weights to shards, cache build", "waiting": "waiting: held, not used"}
#: how a step's phases other than generate and train are hatched (as the GPU parts they are)
PHASE_HATCH = {**PHASE_CATEGORY, "wait GPUs": "waiting", "sync": "sync"}
ROW = 0.8  # bar height (rows are 1 apart)
STEP_ROW = 0.6  # a pipeline's steps: room above for its version labels


def _mix(rgb: tuple[float, ...], towards: float, amount: float) -> tuple[float, float, float]:
    return tuple(c + (towards - c) * amount for c in rgb[:3])  # type: ignore[return-value]


def pipeline_colours(pipelines: list[str]) -> dict[str, tuple[float, float, float]]:
    # deferred: matplotlib takes most of a second to import; only drawing needs it
    from matplotlib import colormaps

    base = colormaps["tab10"].colors + colormaps["Dark2"].colors
    return {p: tuple(base[i % len(base)][:3]) for i, p in enumerate(pipelines)}  # type: ignore[misc]


def shade(rgb: tuple[float, float, float], kind: str) -> tuple[float, float, float]:
    """A role's shade of its pipeline's colour: train darker, generate lighter."""
    return _mix(rgb, 0.0, 0.25) if kind == "train" else _mix(rgb, 1.0, 0.5)


def setup_cut(tl: Timeline) -> float:
    """Seconds at the start left out of the chart: a run's setup (Ray, processes, models) can
    take most of a short run with no GPU held; drawn, it would squeeze the run into a corner."""
    starts = [h.start for hs in tl.holdings.values() for h in hs if h.pipeline is not None]
    starts += [s.start for spans in (*tl.phases.values(), *tl.shard_spans.values()) for s in spans]
    lead = min(starts, default=tl.start) - tl.start
    if lead <= 0.15 * tl.span_s:
        return 0.0
    return max(0.0, lead - 0.03 * (tl.span_s - lead))


def draw_png(tl: Timeline, path: str | Path, title: str = "") -> Path:
    # deferred: matplotlib takes most of a second to import; only drawing needs it. A Figure
    # of its own (no pyplot): no backend or global state of the caller's is touched
    from matplotlib.figure import Figure
    # deferred: as above
    from matplotlib.patches import Patch

    colours = pipeline_colours(tl.pipelines)
    n_gpu, n_pipe = len(tl.gpus), len(tl.pipelines)
    height = 1.9 + 0.34 * (n_gpu + n_pipe) + 0.3 * (1 + (2 * n_pipe + 4) // 6)
    fig = Figure(figsize=(13, max(4.0, height)), dpi=110)
    ax, bx = fig.subplots(2, 1, sharex=True,
                          gridspec_kw={"height_ratios": [max(n_gpu, 1), max(n_pipe, 1) * 0.9]})
    t0 = tl.start

    # GPUs: row i from the top; one bar collection per row and style (a long run has many)
    labels = []
    for i, g in enumerate(tl.gpus):
        y = n_gpu - 1 - i
        node = tl.node_of.get(g)
        labels.append((y, f"node {node} · GPU {g}" if node is not None else f"GPU {g}"))
        ax.axhspan(y - ROW / 2, y + ROW / 2, color=(0.95, 0.95, 0.95), lw=0, zorder=0)
        bars: dict[tuple, list[tuple[float, float]]] = {}
        hatched: dict[str, list[tuple[float, float]]] = {}
        for h in tl.holdings[g]:
            if h.kind == "lost":
                bars.setdefault(("lost",), []).append((h.start - t0, h.end - h.start))
            if h.pipeline is None:
                continue
            bars.setdefault((h.pipeline, h.kind), []).append((h.start - t0, h.end - h.start))
            for part in h.parts:
                if part.category in HATCHES:
                    hatched.setdefault(part.category, []).append((part.start - t0, part.end - part.start))
        for key, xs in bars.items():
            if key == ("lost",):
                ax.broken_barh(xs, (y - ROW / 2, ROW), facecolors=(0.35, 0.35, 0.35), hatch="xx",
                               edgecolor="white", lw=0, zorder=1)
            else:
                ax.broken_barh(xs, (y - ROW / 2, ROW), facecolors=shade(colours[key[0]], key[1]),
                               edgecolor="white", lw=0.8, zorder=1)
        for cat, xs in hatched.items():
            ax.broken_barh(xs, (y - ROW / 2, ROW), facecolors="none", hatch=HATCHES[cat],
                           edgecolor=(0, 0, 0, 0.45), lw=0, zorder=2)
    nodes = [tl.node_of.get(g) for g in tl.gpus]
    for i in range(1, n_gpu):
        if nodes[i] != nodes[i - 1]:
            ax.axhline(n_gpu - i - 0.5, color="black", lw=1.2)
    ax.set_yticks([y for y, _ in labels], [s for _, s in labels])
    ax.set_ylim(-0.6, n_gpu - 0.4)
    ax.set_title(title or "rlix timeline", loc="left", fontsize=11)
    ax.set_title(f"{n_gpu} GPU(s), {tl.span_s:.1f} s", loc="right", fontsize=9)

    # pipelines: one row each, phases in the pipeline's shades, versions as ticks
    for i, p in enumerate(tl.pipelines):
        y = n_pipe - 1 - i
        bx.axhspan(y - STEP_ROW / 2, y + STEP_ROW / 2, color=(0.95, 0.95, 0.95), lw=0, zorder=0)
        styles: dict[str, list[tuple[float, float]]] = {}
        for s in tl.phases.get(p, []):
            styles.setdefault(s.name, []).append((s.start - t0, s.end - s.start))
        for name, xs in styles.items():
            if name in ("generate", "train"):
                face, hatch = shade(colours[p], name), None
            else:  # the step's other phases, hatched as the GPUs' parts are
                face, hatch = _mix(colours[p], 1.0, 0.8), HATCHES[PHASE_HATCH.get(name, "waiting")]
            bx.broken_barh(xs, (y - STEP_ROW / 2, STEP_ROW), facecolors=face, hatch=hatch,
                           edgecolor=(0, 0, 0, 0.45), lw=0, zorder=1)
        versions = [v for v in tl.instants.get(p, []) if v.cat == "version"]
        gap = max(tl.span_s, 1e-6) * 0.02  # labels closer than this (~2 label widths) are skipped
        last = None
        for k, v in enumerate(versions):
            bx.plot([v.at - t0] * 2, [y - STEP_ROW / 2, y + STEP_ROW / 2], color="black", lw=1.0, zorder=3)
            if last is None or v.at - last >= gap or k == len(versions) - 1 and v.at - last >= gap / 2:
                bx.text(v.at - t0, y + STEP_ROW / 2 + 0.02, v.name, fontsize=7, ha="center", va="bottom",
                        zorder=4)
                last = v.at
    bx.set_yticks(list(range(n_pipe - 1, -1, -1)), [f"{p} steps" for p in tl.pipelines])
    bx.set_ylim(-0.6, n_pipe - 0.2)
    left = setup_cut(tl)
    bx.set_xlim(left, max(tl.span_s, 1e-6))
    bx.set_xlabel("seconds since the run started" + (
        f" (the first {left:.0f} s, setting up with no GPU held, not drawn)" if left else ""))

    handles = []
    for p in tl.pipelines:
        handles.append(Patch(facecolor=shade(colours[p], "train"), label=f"{p}: train"))
        handles.append(Patch(facecolor=shade(colours[p], "generate"), label=f"{p}: generate"))
    for cat, hatch in HATCHES.items():
        handles.append(Patch(facecolor="white", edgecolor=(0, 0, 0, 0.6), hatch=hatch,
                             label=LEGEND[cat]))
    handles.append(Patch(facecolor=(0.95, 0.95, 0.95), label="idle"))
    if any(h.kind == "lost" for hs in tl.holdings.values() for h in hs):
        handles.append(Patch(facecolor=(0.35, 0.35, 0.35), hatch="xx", label="lost"))
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8,
               frameon=False)
    rows = 1 + (len(handles) - 1) // min(6, len(handles))
    fig.tight_layout(rect=(0, 0.045 * rows * 4.5 / max(4.0, height), 1, 1))
    path = Path(path)
    fig.savefig(path)
    return path
