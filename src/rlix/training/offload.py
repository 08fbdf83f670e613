"""Training state moved off its GPU into page-locked host memory and back.

A time-shared trainer gives its GPU away between steps: its parameters, buffers and optimizer
moments go to host memory after the step and come back before the next. The host side is
page-locked buffers made once and reused by every offload: pinning is slow (seconds per few
GiB) and pinned copies run several times faster than pageable ones (../shared/device/NOTES.md).
rlix's own trainer (PolicyTrainer) and an external program's loop (rlix.client) both move their
state through HostOffload.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import NamedTuple

import torch


class StateTensor(NamedTuple):
    """One tensor of the state: a key stable across steps (its host buffer's), the tensor, and
    how to put a tensor in its place (a parameter's .data, a buffer's slot, an optimizer entry)."""

    key: Hashable
    tensor: torch.Tensor
    put: Callable[[torch.Tensor], None]


def module_tensors(model: torch.nn.Module, tag: str = "model") -> Iterator[StateTensor]:
    """A module's parameters (tied ones once) and buffers."""
    for name, p in model.named_parameters():
        yield StateTensor((tag, "p", name), p.data, lambda t, p=p: setattr(p, "data", t))
    for mod_name, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None:
                yield StateTensor((tag, "b", mod_name, bname), buf,
                                  lambda t, mod=mod, bname=bname: mod._buffers.__setitem__(bname, t))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
    """An optimizer's per-parameter state tensors (AdamW's moments). Scalar `step` counters are
    left where they are: non-capturable AdamW keeps them on the CPU."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                yield StateTensor(("opt", id(param), key), value,
                                  lambda t, state=state, key=key: state.__setitem__(key, t))


def state_bytes(tensors: Iterable[StateTensor]) -> int:
    return sum(s.tensor.numel() * s.tensor.element_size() for s in tensors)


class HostOffload:
    """The host side of one CUDA device's state: `host[key]` is the page-locked buffer a tensor
    goes to, made at its first offload (or given beforehand) and reused while its shape and
    dtype hold."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.host: dict[Hashable, torch.Tensor] = {}

    def move(self, tensors: Iterable[StateTensor], device: torch.device) -> None:
        """Every tensor not already on `device`'s type to it: to the host buffers (device is the
        CPU) or back to this device. Waits for all copies before any source is let go."""
        to_host = device.type == "cpu"
        moved: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = []
        for key, tensor, put in list(tensors):
            if tensor.device.type == device.type:
                continue
            if to_host:
                host = self.host.get(key)
                if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    self.host[key] = host
                host.copy_(tensor, non_blocking=True)
                moved.append((put, host))
            else:
                moved.append((put, tensor.to(device, non_blocking=True)))
        torch.cuda.synchronize(self.device)  # every copy done before the sources are let go
        for put, tensor in moved:
            put(tensor)
