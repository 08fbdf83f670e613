"""The weight audit's two sides: what a shard says it serves, in the trainer's terms, and how
the two are compared. The coordinator audits every synced shard with these (audit_weights)."""

from __future__ import annotations

from collections.abc import Mapping

from rlix.inference.fleet.fleet import ShardFleet
from rlix.weights.vllm.names import PACKED_AWAY_DIGEST, Digest, digest_matches


async def engine_checksums(fleet: ShardFleet, ranks: list[int]) -> dict[int, dict]:
    """rlix's engine server: per-tensor checksums of what it serves, by the trainer's names."""
    answers = await fleet.client.fan_out("GET", "/weight_checksums", ranks)
    return {r: answers[r]["checksums"] for r in ranks}


#: a served checksum that says the tensor's value cannot be read back (not a mismatch)
UNOBSERVABLE = "unobservable"


async def vllm_checksums(fleet: ShardFleet, ranks: list[int]) -> dict[int, dict]:
    """A vLLM server: its own /weight_checker digests, by its names, without the worker prefix;
    weights its CPU backend packed away (vllm.names.packed_away) are UNOBSERVABLE."""
    answers = await fleet.client.fan_out("POST", "/weight_checker", ranks, json={"action": "checksum"})
    out = {}
    for r in ranks:
        got = {n.rsplit(":", 1)[-1]: d for n, d in answers[r]["checksums"].items()}
        out[r] = {n: (UNOBSERVABLE if d == PACKED_AWAY_DIGEST else d) for n, d in got.items()}
    return out


def mismatches(want: Mapping[str, int | Digest], got: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """(tensors whose served digest differs from the trainer's, served tensors it does not know);
    an UNOBSERVABLE tensor is no mismatch, but a shard where none is observable is one."""
    bad = sorted(n for n in want if not digest_matches(want[n], got.get(n)) and got.get(n) != UNOBSERVABLE)
    extra = sorted(set(got) - set(want))
    if got and all(d == UNOBSERVABLE for d in got.values()):
        bad = ["(no served weight is observable)"]
    return bad, extra
