"""Samples a researcher can read: a few trajectories of every trained batch with their prompt and
response as text, reward, advantage and length. Token ids alone (record_rollouts) hide what the
policy actually writes, such as a reward being gamed by a repeated answer.

RUN_DIR/PIPELINE/samples.jsonl gets one JSON row per sample (`SampleRow`, with its step), appended
as steps end and cut back to the checkpoint's step on resume, as metrics.jsonl is. The console
shows a short table of them (`console_lines`, texts cut), the trackers a text table
(`markdown_table`) or a wandb.Table.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from rlix.pipeline.rollout.types import Group
from rlix.training.types import TrainSample

SAMPLES_FILE = "samples.jsonl"
#: columns of the trackers' tables, in order
COLUMNS = ("step", "prompt", "response", "reward", "advantage", "response_tokens", "finish_reason")
#: the console's table: characters of a prompt and a response shown, and the table's widest width
CONSOLE_PROMPT_CHARS = 40
CONSOLE_RESPONSE_CHARS = 72
CONSOLE_WIDTH = 140
#: characters of each text kept in a TensorBoard text table (the event file holds every step's)
TRACKER_TEXT_CHARS = 2000


@dataclass(frozen=True)
class SampleRow:
    """One trajectory of a trained batch, readable."""

    step: int  # the step that trained on it
    group_id: str
    prompt: str
    response: str  # decoded without special tokens, as the reward function saw it
    reward: float
    advantage: float
    response_tokens: int
    finish_reason: str  # "length": stopped by its token limit
    version: int  # the oldest weight version that generated it

    def as_dict(self) -> dict:
        return asdict(self)


def pick(step: int, groups: Sequence[Group], samples: Sequence[TrainSample], k: int,
         decode: Callable[[list[int]], str]) -> list[SampleRow]:
    """`k` trajectories of the batch, taken across its groups in turn (the first sample of each
    group, then the second, ...), so a few rows show as many prompts as they can. `samples` are
    the trainer's view of the same trajectories, in the groups' order (their advantages)."""
    if k <= 0:
        return []
    advantages: dict[str, float] = {}
    flat = [t for g in groups for t in g.trajectories]
    for t, s in zip(flat, samples):
        advantages[t.id] = float(s.advantage)
    chosen = []
    for i in range(max((len(g.trajectories) for g in groups), default=0)):
        for g in groups:
            if i < len(g.trajectories) and len(chosen) < k:
                chosen.append((g, g.trajectories[i]))
    return [SampleRow(step=step, group_id=g.group_id, prompt=g.prompt, response=decode(list(t.response_ids)),
                      reward=float(t.reward), advantage=advantages.get(t.id, 0.0),
                      response_tokens=len(t.response_ids), finish_reason=t.finish_reason, version=int(t.version))
            for g, t in chosen]


def append_samples(path: Path, rows: Sequence[SampleRow]) -> None:
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r.as_dict()) + "\n" for r in rows))


def keep_until(path: Path, step: int) -> None:
    """Drop the rows of steps after `step` (a resume trains them again; 0: a fresh start drops
    all). A line cut short by a kill is dropped too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(row.get("step", 0)) <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def read_samples(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def single_line(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis: line breaks shown as ⏎,
    tabs as spaces, other unprintable characters (a random policy writes any) escaped."""
    out = []
    for ch in text.replace("\r\n", "\n"):
        if ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append(" ")
        elif not ch.isprintable():
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    flat = "".join(out)
    return flat if len(flat) <= limit else flat[:max(limit - 1, 0)] + "…"


def console_lines(rows: Sequence[dict]) -> list[str]:
    """A short plain-text table of sample rows (as `SampleRow.as_dict` gives them): reward,
    advantage, tokens and finish reason, the prompt and response cut to one line each."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column, justify in (("reward", "right"), ("adv", "right"), ("tokens", "right"),
                            ("end", "left"), ("prompt", "left"), ("response", "left")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(f"{r['reward']:.3f}", f"{r['advantage']:+.2f}", str(r["response_tokens"]),
                      r["finish_reason"] or "-", single_line(r["prompt"], CONSOLE_PROMPT_CHARS),
                      single_line(r["response"], CONSOLE_RESPONSE_CHARS))
    out = io.StringIO()
    Console(file=out, width=CONSOLE_WIDTH, color_system=None, force_terminal=False).print(table)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]


def markdown_table(rows: Sequence[SampleRow]) -> str:
    """The rows as a Markdown table (TensorBoard renders its text summaries as Markdown)."""

    def cell(text: str) -> str:
        return single_line(text, TRACKER_TEXT_CHARS).replace("|", "\\|")

    lines = ["| reward | advantage | tokens | end | prompt | response |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.reward:.3f} | {r.advantage:+.3f} | {r.response_tokens} | {r.finish_reason or '-'} | "
              f"{cell(r.prompt)} | {cell(r.response)} |" for r in rows]
    return "\n".join(lines)

