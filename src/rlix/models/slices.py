"""A checkpoint read a slice at a time: what a sharded trainer rank (FSDP2: rows) and a
tensor-parallel engine rank (its heads' rows or columns) keep, without the whole model in one
process.

`row_reader(folder)` reads rows [lo, hi) of a parameter: drawn for a seeded preset (models/init.py),
else cut out of the checkpoint's safetensors files (only those bytes are read). A model built on
the meta device has no real buffers; `host_buffers` computes them as the model computes them at
build (the rotary embedding's frequencies, the only buffers of the decoders supported).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from rlix.errors import ConfigError
from rlix.models.init import is_seeded, seeded_rows

RowReader = Callable[[str, int, int], torch.Tensor]


def row_reader(folder: Path) -> RowReader:
    """`read(name, lo, hi)`: rows [lo, hi) of parameter `name` on the host, in the dtype stored
    (ConfigError for a folder without safetensors files or a name it does not hold)."""
    if is_seeded(folder):
        return lambda name, lo, hi: seeded_rows(folder, name, lo, hi)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = {n: f for f in sorted(folder.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
    if not files:
        raise ConfigError(f"{folder}: reading a model a slice at a time needs safetensors files (or a seeded "
                          "preset); none there")

    def read(name: str, lo: int, hi: int) -> torch.Tensor:
        if name not in files:
            raise ConfigError(f"{folder}: the checkpoint has no tensor {name!r}")
        with safe_open(str(files[name]), "pt") as f:
            return f.get_slice(name)[lo:hi]
    return read


def host_buffers(skeleton: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of a model built on the meta device, with real values on the host."""
    decoder = skeleton.get_decoder()
    rotary = decoder.rotary_emb
    with torch.device("cpu"):
        real = type(rotary)(config=skeleton.config)
    prefix = next(n for n, m in skeleton.named_modules() if m is rotary)
    out = {f"{prefix}.{n}": b.detach().clone() for n, b in real.named_buffers()}
    missing = [n for n, _ in skeleton.named_buffers() if n not in out]
    if missing:
        raise ConfigError(f"{type(skeleton).__name__}: no values for buffers {missing[:4]} of a model read in slices")
    return out
