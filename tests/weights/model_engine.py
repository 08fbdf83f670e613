"""Test scaffolding: a minimal engine that keeps the weight-update contract (staged, invisible
until finish), for the weight tests, bench/weight_sync.py and pipe_shard.py. The real engines
(embedded, vLLM) bring their own update_weights."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from rlix.errors import WeightUpdateError
from rlix.weights.wire import Layout, TensorEntry

Spec = tuple[tuple[int, ...], torch.dtype]


def _check(specs: Mapping[str, Spec], named: Mapping[str, torch.Tensor]) -> None:
    """Validate every tensor before touching anything (a list comprehension: cheap per tensor)."""
    bad = [n for n, t in named.items()
           if (s := specs.get(n)) is None or t.shape != s[0] or t.dtype != s[1]]
    if not bad:
        return
    msgs = []
    for n in bad[:5]:
        t, s = named[n], specs.get(n)
        msgs.append(f"{n}: not a tensor of this model" if s is None else
                    f"{n}: got {t.dtype} {tuple(t.shape)}, the model has {s[1]} {s[0]}")
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise WeightUpdateError("weights refused: " + "; ".join(msgs) + more)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if not dsts:
        return
    with torch.no_grad():
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None and all(d.device == s.device for d, s in zip(dsts, srcs)):
            foreach(dsts, srcs)
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every name a parameter or buffer is known by (tied aliases included)."""
    out = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    out.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n not in out)
    return out


def load_into_model(model: torch.nn.Module | Mapping[str, torch.Tensor],
                    named_tensors: Mapping[str, torch.Tensor]) -> int:
    """copy_ each tensor into the existing parameter/buffer of that name, in place (storage
    stays put, so CUDA graphs and optimiser references stay valid). All names, shapes and
    dtypes are checked before the first byte is copied. Returns the number of tensors loaded."""
    targets = model_tensors(model) if isinstance(model, torch.nn.Module) else dict(model)
    _check({n: (tuple(t.shape), t.dtype) for n, t in targets.items()}, named_tensors)
    names = list(named_tensors)
    _copy_all([targets[n].data for n in names], [named_tensors[n] for n in names])
    return len(names)


class ModelEngine:
    """The weight-update half of EngineAPI over a model or a dict of tensors.

    Updates are copied into staging tensors (allocated once, reused) and become visible only at
    finish: a dict-backed engine flips staging and served (O(1)); a module-backed one copies the
    staged tensors into its parameters in place with load_into_model. Any refusal drops the
    staging, so the old weights keep serving. probe() answers at any time, as generation would.

    A dict-backed engine also adopts the transfer's bucket layout (adopt_layout): its weights
    then live in two flat buffers shaped like the buckets (served, staging), and an update is
    one copy per bucket whatever the number of tensors (weight_bucket).
    """

    def __init__(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], *,
                 device: str | torch.device | None = None, version: int = 0,
                 adopt_layouts: bool = True) -> None:
        self.module = weights if isinstance(weights, torch.nn.Module) else None
        self.adopt_layouts = adopt_layouts
        if self.module is not None:
            if device is not None:
                self.module.to(device)
            served = {n: p.data for n, p in self.module.named_parameters()}
        else:
            served = {n: (t.to(device) if device is not None else t) for n, t in weights.items()}
        self._served = served
        self._specs: dict[str, Spec] = {n: (tuple(t.shape), t.dtype) for n, t in served.items()}
        self._staging: dict[str, torch.Tensor] | None = None
        self._ptrs: dict[int, str] = {}
        self._updating: int | None = None
        self._got: set[str] = set()
        self._flat: list[torch.Tensor] = []  # [served, staging] when a layout is adopted
        self._layout_id = ""
        self._bucket_maps: list[list[dict[str, torch.Tensor]]] = []
        self._spans: list[tuple[int, int]] = []
        self._own_ids: list[set[int]] = [set(), set()]
        self._flat_ptrs: list[dict[int, str]] = [{}, {}]
        self._on_cuda = any(t.is_cuda for t in served.values())
        self.weight_version = int(version)
        self.aborts: list[str] = []
        self.max_model_len = 0

    def weight_specs(self) -> dict[str, Spec]:
        return dict(self._specs)

    def served(self) -> dict[str, torch.Tensor]:
        """The tensors generation would use now."""
        if self.module is not None:
            return {n: p.data for n, p in self.module.named_parameters()}
        return dict(self._served)

    def probe(self) -> tuple[int, float]:
        """Answer as a serving engine would: (weight version, a fingerprint of the weights)."""
        total = 0.0
        for t in self.served().values():
            if t.numel():
                total += float(t.reshape(-1)[:64].double().sum())
        return self.weight_version, total

    def weight_destination(self, name: str) -> torch.Tensor | None:
        """Where a split tensor may be assembled directly (the staging tensor of that name)."""
        if self._updating is None or self._staging is None:
            return None
        return self._staging.get(name)

    def adopt_layout(self, layout: Layout) -> bool:
        """Re-home the weights in the bucket layout (called once per layout, outside updates)."""
        if self._flat and layout.layout_id == self._layout_id:
            return True  # already in this layout (a new driver re-sent it)
        if (not self.adopt_layouts or self.module is not None or self._updating is not None
                or layout.specs() != self._specs):
            return False  # only a layout of exactly our tensors (names, shapes, dtypes)
        devices = {t.device for t in self._served.values()}
        if len(devices) != 1:
            return False
        device = devices.pop()
        offsets = layout.bucket_offsets()
        self._spans = list(zip(offsets, layout.bucket_sizes))
        self._flat = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        views = [{e.name: _flat_view(flat, offsets[e.bucket] + e.offset, e) for e in layout.entries}
                 for flat in self._flat]
        _copy_all([views[0][n] for n in self._served], list(self._served.values()))
        self._served, self._staging = views
        self._ptrs = {t.data_ptr(): n for n, t in self._staging.items() if t.numel()}
        self._bucket_maps = [[{} for _ in layout.bucket_sizes] for _ in range(2)]
        for parts in layout.parts_by_bucket:
            for part in parts:
                e = layout.entries[part.entry]
                if part.start + part.nbytes == e.nbytes:  # this bucket completes the tensor
                    for which in range(2):
                        self._bucket_maps[which][part.bucket][e.name] = views[which][e.name]
        self._own_ids = [{id(m) for m in maps} for maps in self._bucket_maps]
        self._flat_ptrs = [{t.data_ptr(): n for n, t in v.items() if t.numel()} for v in views]
        self._ptrs = self._flat_ptrs[1]
        self._layout_id = layout.layout_id
        return True

    def weight_bucket(self, index: int) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None:
        """Where bucket `index` of the adopted layout goes in staging, and the tensors it
        completes (pass that very mapping to update_weights)."""
        if self._updating is None or not self._flat:
            return None
        off, size = self._spans[index]
        return self._flat[1][off: off + size], self._bucket_maps[1][index]

    async def start_weight_update(self, version: int) -> None:
        if self._updating is not None:
            raise WeightUpdateError(f"an update to version {self._updating} is already in progress")
        if self._staging is None:
            self._staging = {n: torch.empty_like(t) for n, t in self._served.items()}
            self._ptrs = {t.data_ptr(): n for n, t in self._staging.items() if t.numel()}
        self._updating, self._got = int(version), set()

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        if self._updating is None or self._staging is None:
            raise WeightUpdateError("no weight update in progress; call start_weight_update first")
        if self._flat and id(named_tensors) in self._own_ids[1]:
            self._got.update(named_tensors)  # our own staging views: already in place
            await asyncio.sleep(0)
            return
        try:
            _check(self._specs, named_tensors)
        except WeightUpdateError as exc:
            self._drop(f"refused: {exc}")
            raise
        staging, ptrs = self._staging, self._ptrs
        pairs = [(staging[n], t) for n, t in named_tensors.items() if ptrs.get(t.data_ptr()) != n]
        # Copied on the calling thread: torch's OpenMP copies issued from a helper thread run
        # several times slower on CPU (a second thread team competing for the same cores).
        _copy_all([d for d, _ in pairs], [s for _, s in pairs])
        await asyncio.sleep(0)  # let generation (and probes) run between buckets
        self._got.update(named_tensors)

    async def finish_weight_update(self) -> int:
        if self._updating is None or self._staging is None:
            raise WeightUpdateError("no weight update in progress; call start_weight_update first")
        if len(self._got) != len(self._specs):
            missing = [n for n in self._specs if n not in self._got]
            self._drop("incomplete")
            raise WeightUpdateError(f"update incomplete: {len(missing)} tensors never arrived "
                                    f"({', '.join(missing[:3])}...); old weights keep serving")
        if self._on_cuda:
            torch.cuda.synchronize()
        if self.module is not None:
            load_into_model(self.module, self._staging)
        else:
            self._served, self._staging = self._staging, self._served
            if self._flat:  # O(1): everything per tensor was prepared at adopt_layout
                for pair in (self._flat, self._bucket_maps, self._own_ids, self._flat_ptrs):
                    pair.reverse()
                self._ptrs = self._flat_ptrs[1]
            else:
                self._ptrs = {t.data_ptr(): n for n, t in self._staging.items() if t.numel()}
        self.weight_version, self._updating = self._updating, None
        return self.weight_version

    async def abort_weight_update(self, reason: str) -> None:
        self._drop(reason)

    def _drop(self, reason: str) -> None:
        if self._updating is not None:
            self.aborts.append(reason)
        self._updating, self._got = None, set()


def _flat_view(flat: torch.Tensor, offset: int, entry: TensorEntry) -> torch.Tensor:
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype, device=flat.device)
    return flat[offset: offset + entry.nbytes].view(entry.dtype).view(entry.shape)
