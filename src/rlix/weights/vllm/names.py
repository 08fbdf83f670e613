"""How vLLM names and fuses a Hugging Face checkpoint's tensors, for auditing what it serves.

vLLM serves q/k/v projections as one `qkv_proj` and gate/up as one `gate_up_proj` (stacked on
dim 0, in that order), drops `lm_head.weight` when it is tied to the embedding, and casts to its
serving dtype. `vllm_digests` applies that to the trainer's tensors and hashes each result the
way vLLM's `/weight_checker` does (sha256 of the raw bytes), so the two can be compared name by
name. Measured equal on vLLM 0.32's CPU build for Qwen2-shaped models.

On CPUs with AMX, vLLM's CPU backend runs small linear layers through a packed kernel and widens
their biases to float32 after loading (`dispatch_cpu_unquantized_gemm`): the value loaded is
the serving dtype's, held wider, and an update later copies the sent values into that float32
parameter as they are. A bias therefore has up to three digests that are all "as sent"
(`Digest`: the forms a served tensor may take).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)


def sha256_of(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def vllm_named(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as vLLM holds them (fused where vLLM fuses), same dtype."""
    out: dict[str, torch.Tensor] = {}
    parts = {p for _, group in FUSED for p in group}
    for name, tensor in tensors.items():
        part = next((p for p in parts if f".{p}." in name), None)
        if part is None:
            out[name] = tensor
            continue
        fused, group = next((f, g) for f, g in FUSED if part in g)
        if part != group[0]:
            continue  # stacked with the group's first member
        members = [name.replace(f".{part}.", f".{p}.") for p in group]
        missing = [m for m in members if m not in tensors]
        if missing:
            raise KeyError(f"{name}: no {missing} to fuse it with")
        out[name.replace(f".{part}.", f".{fused}.")] = torch.cat([tensors[m] for m in members])
    return out


#: one tensor's digest as served: a digest, or the digests of every form vLLM may hold it in
Digest = str | tuple[str, ...]


def served_forms(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> Digest:
    """The digest of `tensor` served in `dtype`; for a bias also those of it held in float32
    (see module doc): loaded in `dtype`, then widened; or updated later, when the float32
    parameter takes the sent values as they are."""
    cast = tensor.to(dtype)
    if not name.endswith(".bias") or dtype == torch.float32:
        return sha256_of(cast)
    return tuple(dict.fromkeys((sha256_of(cast), sha256_of(cast.to(torch.float32)),
                                sha256_of(tensor.to(torch.float32)))))


def digest_matches(want: Digest | int, got: object) -> bool:
    """Whether a served digest is one of the forms the trainer's tensor may be served in."""
    return got in want if isinstance(want, tuple) else got == want


def vllm_digests(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Digest]:
    """sha256 per vLLM parameter of these tensors served in `dtype` (see module doc)."""
    return {name: served_forms(name, t, dtype) for name, t in vllm_named(tensors).items()}


#: what /weight_checker reports for a weight vLLM's CPU backend dropped after packing it for its
#: GEMM kernel (oneDNN: `dispatch_cpu_unquantized_gemm(remove_weight=True)` on the machines where
#: oneDNN takes the linear layers): the digest of zero bytes. Such a value cannot be read back.
PACKED_AWAY_DIGEST = hashlib.sha256(b"").hexdigest()


def packed_away(got: Mapping[str, str]) -> list[str]:
    """The served tensors whose values vLLM no longer holds in readable form (see above)."""
    return sorted(n for n, d in got.items() if d == PACKED_AWAY_DIGEST)


def compare_digests(want: Mapping[str, Digest], got: Mapping[str, str]) -> list[str]:
    """What differs between the trainer's digests and a server's: [] when they match. A tied
    `lm_head.weight` the server does not hold is not a difference, nor a weight vLLM packed
    away (`packed_away`: its value is not observable; the others still are, and a server
    whose every weight is packed away is a problem: nothing could be compared)."""
    hidden = set(packed_away(got))
    problems = [f"{n}: differs" for n in sorted(got)
                if n in want and not digest_matches(want[n], got[n]) and n not in hidden]
    problems += [f"{n}: served, not sent" for n in sorted(set(got) - set(want))]
    problems += [f"{n}: sent, not served" for n in sorted(set(want) - set(got)) if n != "lm_head.weight"]
    if got and hidden >= set(got):
        problems.append("no served weight is observable (all packed away by vLLM's CPU GEMM)")
    return problems
