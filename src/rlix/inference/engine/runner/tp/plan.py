"""Tensor parallelism for the fused decoder: which slice of each weight a rank keeps, and the
one collective the forward needs.

Megatron's split of a Qwen2 / Llama-style layer over `size` ranks of one process group:

- column-parallel (split along the output rows, dim 0): q/k/v projections (weights and biases)
  and the gate/up projections. The rows of q_proj are head-major, so an even split of the rows
  is an even split of the query heads, and of k/v_proj the KV heads: rank r keeps query heads
  [r * H/size, (r + 1) * H/size) and the KV heads their groups read, so attention runs on local
  heads with no communication. The same holds for the intermediate units of gate/up.
- row-parallel (split along the input columns, dim 1): o_proj and down_proj. Each rank's matmul
  over its heads' (units') columns is a partial sum of the full output; one all-reduce (sum)
  per projection makes the full hidden state again, identical on every rank.
- replicated: the token embeddings, the LM head, the norms (and a row-parallel projection's
  bias, to be added once after the reduce; the fused decoder's models have none). A
  vocabulary-parallel embedding would need an all-reduce of its own and a vocabulary-parallel
  head an all-gather of the logits (or a distributed sampler), while replicated ones leave every
  rank with the full logits, so the sampler stays as it is; the norms are a few vectors over the
  hidden size that every rank holds whole after each reduce. The cost is the embeddings and head
  held on every rank.

Every split must be even: the query heads, the KV heads and the intermediate size must each be
divisible by `size` (`ShardPlan` refuses otherwise, naming the count). The same slicing serves
loading and weight updates: a rank receives full tensors under their checkpoint names and keeps
its slice (`shard_tensor`, `shard_state_dict`); `sharded_spec` gives the shape it serves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlix.errors import ConfigError
from rlix.inference.engine.weights import ParamSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _check_place(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"tensor parallel rank {rank} of size {size}: need size >= 1 and "
                          f"0 <= rank < size")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the `size` ranks of a tensor-parallel group; `group` is the
    torch.distributed process group, None only at size 1 (nothing to talk to)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        _check_place(self.rank, self.size)
        if self.size > 1 and self.group is None:
            raise ConfigError(f"tensor parallel size {self.size} needs a process group")

    @staticmethod
    def single() -> TensorParallel:
        return TensorParallel(0, 1, None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group's ranks, in place (x itself at size 1). Called on the group
        itself: an engine's group is made apart from torch.distributed's default one (tp/group.py),
        so that several engines, or an engine beside a trainer, can live in one process."""
        if self.size > 1:
            assert self.group is not None
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            self.group.allreduce([x], options).wait()
        return x


class Split(Enum):
    """How a checkpoint tensor is cut across ranks."""

    COLUMN = 0  # along dim 0 (output rows)
    ROW = 1  # along dim 1 (input columns)


class _Unit(Enum):
    """What the split dimension counts, so its full size can be checked."""

    QUERY = "query heads"
    KV = "kv heads"
    INTERMEDIATE = "intermediate units"


_SPLITS: tuple[tuple[re.Pattern[str], Split, _Unit], ...] = (
    (re.compile(r"(^|\.)self_attn\.q_proj\.(weight|bias)$"), Split.COLUMN, _Unit.QUERY),
    (re.compile(r"(^|\.)self_attn\.[kv]_proj\.(weight|bias)$"), Split.COLUMN, _Unit.KV),
    (re.compile(r"(^|\.)mlp\.(gate|up)_proj\.(weight|bias)$"), Split.COLUMN, _Unit.INTERMEDIATE),
    (re.compile(r"(^|\.)self_attn\.o_proj\.weight$"), Split.ROW, _Unit.QUERY),
    (re.compile(r"(^|\.)mlp\.down_proj\.weight$"), Split.ROW, _Unit.INTERMEDIATE),
)


def _split_of(name: str) -> tuple[Split, _Unit] | None:
    for pattern, split, unit in _SPLITS:
        if pattern.search(name):
            return split, unit
    return None


def split_of(name: str) -> Split | None:
    """How the tensor named `name` (a checkpoint name) is split; None: replicated."""
    found = _split_of(name)
    return found[0] if found is not None else None


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`'s cut of a model with these full counts; refuses (ConfigError)
    a size that does not divide the query heads, the KV heads or the intermediate size."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        _check_place(self.rank, self.size)
        for what, count in (("num_attention_heads", self.num_heads),
                            ("num_key_value_heads", self.num_kv_heads),
                            ("intermediate_size", self.intermediate_size)):
            if count % self.size:
                raise ConfigError(f"tensor parallel size {self.size} does not divide the model's "
                                  f"{what} ({count}): every rank must hold the same number")

    @classmethod
    def of(cls, config: PretrainedConfig, tp: TensorParallel) -> ShardPlan:
        """The plan for a transformers config (Qwen2 / Llama / Mistral fields; the fused
        decoder's counts): KV heads default to the query heads, head_dim to hidden / heads."""
        return cls.for_rank(config, tp.rank, tp.size)

    @classmethod
    def for_rank(cls, config: PretrainedConfig, rank: int, size: int) -> ShardPlan:
        """`of` for a place given by number (before any group exists)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(rank, size, heads, kv_heads, head_dim, int(getattr(config, "intermediate_size", 0) or 0))

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    def _full(self, unit: _Unit) -> int:
        if unit is _Unit.QUERY:
            return self.num_heads * self.head_dim
        if unit is _Unit.KV:
            return self.num_kv_heads * self.head_dim
        return self.intermediate_size

    def cut(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's slice of `name`, None when it is not split;
        raises ValueError when the full tensor's split dimension is not the model's count."""
        found = _split_of(name)
        if found is None or self.size == 1:
            return None
        split, unit = found
        dim = split.value
        full = self._full(unit)
        if len(shape) <= dim or shape[dim] != full:
            raise ValueError(f"{name}: shape {shape} is not the full tensor (dim {dim} should be "
                             f"{full}: {unit.value} of the whole model, before any split)")
        length = full // self.size
        return dim, self.rank * length, length


def shard_tensor(plan: ShardPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the full checkpoint tensor `name`, contiguous: a view where the
    slice already is (a column split of a contiguous tensor: whole rows), else a copy (a row
    split); the tensor itself when it is not split."""
    cut = plan.cut(name, tuple(tensor.shape))
    if cut is None:
        return tensor
    dim, start, length = cut
    return tensor.narrow(dim, start, length).contiguous()  # no copy when already contiguous


def shard_state_dict(plan: ShardPlan, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of `named` (full, by checkpoint name) cut to this rank's slice."""
    return {name: shard_tensor(plan, name, tensor) for name, tensor in named.items()}


def sharded_spec(plan: ShardPlan, spec: ParamSpec) -> ParamSpec:
    """The spec of what this rank serves for the full parameter `spec`."""
    cut = plan.cut(spec.name, spec.shape)
    if cut is None:
        return spec
    dim, _, length = cut
    shape = list(spec.shape)
    shape[dim] = length
    return replace(spec, shape=tuple(shape))


def unsharded_shape(plan: ShardPlan, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The whole model's shape of parameter `name`, of which this rank holds `shape`."""
    found = _split_of(name)
    if found is None or plan.size == 1:
        return tuple(shape)
    dim = found[0].value
    full = list(shape)
    full[dim] *= plan.size
    return tuple(full)


def gather_full(tp: TensorParallel, name: str, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor `name` from every rank's slice `local` (all ranks must call this for
    the same names in the same order: an all-gather); `local` itself when it is not split."""
    found = _split_of(name)
    if found is None or tp.size == 1:
        return local
    assert tp.group is not None
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    tp.group.allgather([parts], [local.contiguous()]).wait()
    return torch.cat(parts, dim=found[0].value)


def shard_model(model: torch.nn.Module, plan: ShardPlan) -> None:
    """Replace the split parameters of a (full) model by this rank's slices, in memory of their
    own, so the full tensors can be freed; the model's transformers forward no longer applies
    (only the fused decoder runs a sharded model)."""
    if plan.size == 1:
        return
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        full = param.data
        piece = shard_tensor(plan, name, full)
        if piece is full:
            continue
        shares = piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        param.data = piece.clone() if shares else piece
