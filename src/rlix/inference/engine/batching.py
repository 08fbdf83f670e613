"""Which waiting requests are prefilled together: pure planning over prompt lengths and the
samples of one request (they enter the batch together, and only the first is prefilled; the
others fork its cache row)."""

from __future__ import annotations

from collections import deque

from rlix.inference.engine.sequence import Sequence


def plan_prefill_groups(lengths: list[int], max_waste: float = 0.25,
                        max_padded_tokens: int | None = None) -> list[list[int]]:
    """Split prompts (indices into `lengths`) into right-padded batches wasting <= max_waste.

    Longest first; a prompt joins the current group while padding stays under the bound (and
    the padded batch under max_padded_tokens), so a 64-token prompt does not make seven 8-token
    prompts pay for 64 positions each.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            width = lengths[group[0]]
            padded = width * (len(group) + 1)
            real = sum(lengths[j] for j in group) + lengths[i]
            if padded <= real * (1 + max_waste) and (max_padded_tokens is None
                                                     or padded <= max_padded_tokens):
                group.append(i)
                continue
        groups.append([i])
    return groups


def samples_from(waiting: deque[Sequence], i: int) -> int:
    """How many queued entries from waiting[i] are one request's samples (they enter together)."""
    seq, count = waiting[i], 1
    while seq.group is not None and i + count < len(waiting) and waiting[i + count].group is seq.group:
        count += 1
    return count


def request_leaders(admitted: list[Sequence]) -> tuple[list[Sequence], dict[Sequence, list[Sequence]]]:
    """The sequences to prefill, and for each the other samples of its request (its forks)."""
    leaders: list[Sequence] = []
    forks: dict[Sequence, list[Sequence]] = {}
    first_of: dict[int, Sequence] = {}
    for seq in admitted:
        if seq.group is None:
            leaders.append(seq)
        elif (leader := first_of.get(id(seq.group))) is None:
            first_of[id(seq.group)] = seq
            leaders.append(seq)
        else:
            forks.setdefault(leader, []).append(seq)
    return leaders, forks
