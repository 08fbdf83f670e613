"""Seeded presets: the weights drawn where they are loaded, instead of read from files.

A seeded preset's folder (models/presets.py) holds config.json, the generation config, the
tokenizer and `rlix_init.json` (preset, seed, initializer_range, recipe, block_rows), no weights.
`load_causal_lm` builds the model's skeleton on the meta device and then fills each parameter
on the target device as transformers' `_init_weights` initialises Qwen2: Linear and Embedding
weights normal(0, initializer_range) (the embedding's padding row zero), biases zero, RMSNorm
weights one; tied weights stay one tensor; the rotary embedding is built for real (its inverse
frequencies are computed, not stored).

Values are a pure function of (seed, tensor name, row): the rows of a tensor come in blocks of
`block_rows`, each drawn by its own CPU generator seeded from sha256(seed, name, block). So every
process of a run gets the same bits whatever its device, and a sharded trainer rank draws only
its rows (`seeded_rows`). Draws are float64: torch's float32 `randn` takes a vectorised path that
depends on the CPU's instruction set (AVX2 and AVX-512 hosts disagree with others in the last
bit), its float64 one does not. A draw is scaled in float64, rounded to float32 (the value a
float32 initialisation gives), then to the preset's dtype (the value a saved checkpoint holds),
then to the dtype asked for: loading a seeded preset in another dtype is loading its checkpoint
in another dtype.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2RMSNorm, Qwen2RotaryEmbedding

from rlix.errors import ConfigError
from rlix.models.presets import InitRecipe, is_seeded

__all__ = ["TensorInit", "is_seeded", "load_causal_lm", "seeded_rows"]


@dataclass(frozen=True)
class TensorInit:
    """How one parameter starts. `key` names its random stream: the first name of the tensor
    (a tied weight's other names draw the same values)."""

    key: str
    shape: tuple[int, ...]
    fill: Literal["normal", "zeros", "ones"]
    std: float = 0.0
    zero_row: int | None = None  # an Embedding's padding_idx: transformers zeroes that row


def _skeleton(folder: Path, dtype: torch.dtype | None,
              attn_implementation: str | None) -> tuple[Qwen2ForCausalLM, torch.dtype]:
    """The model on the meta device (no memory) and the dtype its weights are stored in."""
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = AutoConfig.from_pretrained(folder, **kwargs)
    stored = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or stored, **kwargs)
    if not isinstance(model, Qwen2ForCausalLM):
        raise ConfigError(f"{folder}: a seeded preset must be a Qwen2 model, not {type(model).__name__}")
    return model, stored


def _plan(model: nn.Module, std: float) -> dict[str, TensorInit]:
    """Every parameter name (tied ones under each of their names) -> how it starts."""
    first: dict[int, TensorInit] = {}
    plan: dict[str, TensorInit] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{attr}" if prefix else attr
            if id(param) not in first:
                first[id(param)] = _rule(name, module, attr, tuple(param.shape), std)
            plan[name] = first[id(param)]
    return plan


def _rule(name: str, module: nn.Module, attr: str, shape: tuple[int, ...], std: float) -> TensorInit:
    if isinstance(module, nn.Linear):
        return TensorInit(name, shape, "normal", std) if attr == "weight" else TensorInit(name, shape, "zeros")
    if isinstance(module, nn.Embedding):
        return TensorInit(name, shape, "normal", std, zero_row=module.padding_idx)
    if isinstance(module, Qwen2RMSNorm):
        return TensorInit(name, shape, "ones")
    raise ConfigError(f"no seeded initialisation for {name} ({type(module).__name__}.{attr})")


@functools.lru_cache(maxsize=8)
def _folder_plan(folder: str) -> tuple[InitRecipe, dict[str, TensorInit], torch.dtype]:
    recipe = InitRecipe.read(Path(folder))
    model, stored = _skeleton(Path(folder), None, None)
    return recipe, _plan(model, recipe.initializer_range), stored


def _block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.sha256(f"rlix-seeded/{seed}/{key}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a generator seed is a non-negative int64


def _fill(out: torch.Tensor, spec: TensorInit, recipe: InitRecipe, stored: torch.dtype, lo: int) -> None:
    """Write rows [lo, lo + len(out)) of `spec` into `out` (CPU, any dtype)."""
    hi = lo + out.shape[0]
    if spec.fill != "normal":
        out.fill_(0.0 if spec.fill == "zeros" else 1.0)
        return
    rows, rest = recipe.block_rows, spec.shape[1:]

    def draw(block: int) -> None:
        b0, b1 = block * rows, min((block + 1) * rows, spec.shape[0])
        generator = torch.Generator().manual_seed(_block_seed(recipe.seed, spec.key, block))
        values = torch.randn((b1 - b0, *rest), generator=generator, dtype=torch.float64)
        values = values.mul_(spec.std).to(torch.float32).to(stored)
        s0, s1 = max(b0, lo), min(b1, hi)
        out[s0 - lo:s1 - lo].copy_(values[s0 - b0:s1 - b0])

    blocks = range(lo // rows, -(-hi // rows))
    threads = max(1, min(torch.get_num_threads(), len(blocks)))
    if threads == 1:
        for block in blocks:
            draw(block)
    else:  # each block writes its own rows; torch drops the GIL while it draws
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(draw, blocks))
    if spec.zero_row is not None and lo <= spec.zero_row < hi:
        out[spec.zero_row - lo].zero_()


def _check_rows(name: str, spec: TensorInit, lo: int, hi: int) -> None:
    if not 0 <= lo <= hi <= spec.shape[0]:
        raise ValueError(f"rows [{lo}, {hi}) are outside {name}'s {spec.shape[0]} rows")


def seeded_rows(path: str | os.PathLike[str], name: str, lo: int, hi: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows [lo, hi) of parameter `name` of the seeded preset in folder `path`, on the CPU, in
    `dtype` (None: the preset's): the same values as those rows of `load_causal_lm`'s tensor.
    (A 1-D parameter's rows are its elements.)"""
    recipe, plan, stored = _folder_plan(os.fspath(Path(path).resolve()))
    spec = plan.get(name)
    if spec is None:
        raise KeyError(f"{name!r} is not a parameter of {path}")
    _check_rows(name, spec, lo, hi)
    out = torch.empty((hi - lo, *spec.shape[1:]), dtype=dtype or stored)
    _fill(out, spec, recipe, stored, lo)
    return out


def _materialise(model: Qwen2ForCausalLM, recipe: InitRecipe, stored: torch.dtype,
                 device: torch.device) -> None:
    """Replace every meta parameter by its drawn values on `device`, and the rotary embedding by
    one built for real."""
    plan = _plan(model, recipe.initializer_range)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    first: dict[int, tuple[nn.Parameter, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
            first.setdefault(id(param), (param, f"{prefix}.{attr}" if prefix else attr))
    for key, (param, name) in first.items():
        spec = plan[name]
        host = torch.empty(spec.shape, dtype=param.dtype)
        _fill(host, spec, recipe, stored, 0)
        real = nn.Parameter(host.to(device), requires_grad=param.requires_grad)
        for owner, attr in owners[key]:  # tied: every owner gets the one tensor
            setattr(owner, attr, real)
    with torch.device("cpu"):  # computed as a model built on the CPU computes it, then moved
        rotary = Qwen2RotaryEmbedding(config=model.config)
    model.model.rotary_emb = rotary.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"cannot materialise the seeded model: no values for {', '.join(left[:4])}")


def load_causal_lm(path: str | os.PathLike[str], dtype: torch.dtype | None = None,
                   device: str | torch.device = "cpu",
                   attn_implementation: str | None = None) -> torch.nn.Module:
    """The whole model of checkpoint folder `path` on `device`, in eval mode: read with
    `from_pretrained` from an ordinary folder, drawn for a seeded preset. dtype None: the saved one."""
    folder, device = Path(path), torch.device(device)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if not is_seeded(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", **kwargs).to(device)
    recipe = InitRecipe.read(folder)
    model, stored = _skeleton(folder, dtype, attn_implementation)
    with torch.no_grad():
        _materialise(model, recipe, stored, device)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()

