"""Slot-based KV cache that plugs into a transformers model's attention layers.

Why not transformers' own caches: DynamicCache grows one batch in lockstep, and the paged cache of
its continuous batching gathers every step's keys from scattered pages, where a static batch reads
one contiguous view. Here every running sequence owns one *row* of a preallocated [rows, kv_heads, capacity, head_dim]
tensor per layer; rows 0..n-1 are always the running sequences, in batch order (a leaving
sequence's row is filled by moving the last row into it), so the keys of a decode step are a
plain view `k[:n, :, :L]` and an additive mask hides each row's positions past its own length.
All layers' K and V live in one [layers, 2, rows, kv_heads, capacity, head_dim] tensor, so
moving or copying rows (retirement, the n samples of one prompt) is one copy for every layer,
not 2 x layers small ones launched from Python.

Transformers calls `update(key_states, value_states, layer_idx)` from every attention layer; the
engine sets the step's geometry (`set_prefill` / `set_decode`) before each forward.

With `virtual=True` (CUDA graphs on a device with virtual memory management, vmm.py) the
tensor lives at addresses reserved once, at full max_len: `free` gives its memory back to the
driver and `allocate` maps new memory at the same addresses, so the captured graphs that hold
them stay valid across a sleep (`storage_version` moves only when the addresses do).
"""

from __future__ import annotations

import torch

from rlix.inference.engine.runner.vmm import VirtualBuffer


#: Positions per row allocated up front (the cache doubles, up to max_len, when a sequence
#: needs more). Small, because every wake after a sleep allocates it again, and on CPU touching
#: a large cache was most of a wake's time. CUDA-graph decode allocates the full max_len instead
#: (its storage must not move).
DEFAULT_INITIAL_CAPACITY = 64


class SlotKVCache:
    """Per-layer K and V for up to `num_rows` sequences of up to `max_len` tokens."""

    def __init__(self, *, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, virtual: bool = False) -> None:
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.initial_capacity = max(1, min(initial_capacity, max_len))
        self.capacity = 0
        self.storage_version = 0  # bumped whenever the storage moves (CUDA graphs hold pointers)
        #: the tensor lives in a VirtualBuffer (module docstring); made at the first allocate
        self.virtual = virtual
        self._buffer: VirtualBuffer | None = None
        self.kv: torch.Tensor | None = None  # [layers, 2, rows, kv_heads, capacity, head_dim]
        self.keys: list[torch.Tensor] = []  # views of kv, one per layer
        self.values: list[torch.Tensor] = []
        # Geometry of the forward in progress (see set_prefill / set_decode).
        self._mode = "none"
        self._rows = slice(0, 0)
        self._row_index: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._kv_len = 0
        self._n = 0

    # -- allocation ----------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.capacity > 0

    def allocate(self, capacity: int | None = None) -> None:
        """(Re)allocate zeroed storage; zeros so that host RSS / device memory really hold it.
        A virtual cache is always max_len positions, mapped again at the same addresses."""
        if self.virtual:
            self._allocate_virtual()
            return
        capacity = min(self.max_len, capacity or self.initial_capacity)
        shape = (self.num_layers, 2, self.num_rows, self.num_kv_heads, capacity, self.head_dim)
        self._views(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.storage_version += 1

    def _allocate_virtual(self) -> None:
        shape = (self.num_layers, 2, self.num_rows, self.num_kv_heads, self.max_len, self.head_dim)
        if self._buffer is None:
            nbytes = self.dtype.itemsize
            for n in shape:
                nbytes *= n
            self._buffer = VirtualBuffer(nbytes, self.device)
            self.storage_version += 1  # the first addresses: nothing captured holds them yet
        else:
            self._buffer.remap()
        kv = self._buffer.tensor(self.dtype, shape)
        kv.zero_()
        self._views(kv)

    def _views(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.keys = [kv[i, 0] for i in range(self.num_layers)]
        self.values = [kv[i, 1] for i in range(self.num_layers)]
        self.capacity = kv.shape[4]

    def free(self) -> None:
        """Drop the storage (the caller then trims host memory / empties the CUDA cache); a
        virtual cache unmaps its memory and keeps its addresses for the next allocate."""
        self.kv, self.keys, self.values = None, [], []
        self.capacity = 0
        if self._buffer is not None:
            self._buffer.unmap()
            return
        self.storage_version += 1

    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def mapped_bytes(self) -> int:
        """Device memory mapped into a virtual cache now (0 otherwise, or while it sleeps)."""
        return self._buffer.nbytes if self._buffer is not None and self._buffer.mapped else 0

    def ensure_capacity(self, length: int, live_rows: int, live_len: int) -> None:
        """Grow (doubling, capped at max_len) so positions < length fit; copies live data."""
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds the cache's max_len {self.max_len}")
        if not self.allocated:
            self.allocate(max(self.initial_capacity, length))
            return
        if length <= self.capacity:
            return
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity *= 2
        new_capacity = min(new_capacity, self.max_len)
        old = self.kv
        assert old is not None
        self.allocate(new_capacity)
        assert self.kv is not None
        self.kv[:, :, :live_rows, :, :live_len].copy_(old[:, :, :live_rows, :, :live_len])

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row `src`'s first `length` positions into row `dst` (batch compaction)."""
        self.move_rows([src], [dst], length)

    def move_rows(self, srcs: list[int], dsts: list[int], length: int) -> None:
        """Row srcs[i] -> row dsts[i], first `length` positions, all layers in one copy; the
        two sets must not overlap (retirement moves tail rows into holes below them)."""
        if not srcs or self.kv is None:
            return
        if len(srcs) == 1:
            self.kv[:, :, dsts[0], :, :length].copy_(self.kv[:, :, srcs[0], :, :length])
            return
        src, dst = self._index(srcs), self._index(dsts)
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def copy_rows(self, src: int, dsts: list[int], length: int) -> None:
        """Copy row `src`'s first `length` positions into each row of `dsts` (the samples of one
        prompt after its single prefill: one copy for all layers, whatever their number)."""
        assert self.kv is not None
        self.kv[:, :, self._index(dsts), :, :length] = self.kv[:, :, src: src + 1, :, :length]

    def _index(self, rows: list[int]) -> torch.Tensor:
        """Row numbers on the cache's device, sent from pinned memory: a copy from pageable
        memory would first wait for the decode step still running (engine core: overlap)."""
        index = torch.tensor(rows, dtype=torch.long)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    # -- step geometry -------------------------------------------------------------------
    def set_prefill(self, first_row: int, num_rows: int) -> None:
        """Next forward writes positions 0..T-1 of rows first_row..first_row+num_rows-1."""
        self._mode = "prefill"
        self._rows = slice(first_row, first_row + num_rows)

    def set_decode(self, positions: torch.Tensor, kv_len: int,
                   row_index: torch.Tensor | None = None) -> None:
        """Next forward writes one token per row 0..n-1 at `positions` and reads kv_len keys.

        `row_index` (arange(n)) may be passed so that a captured CUDA graph keeps using it.
        """
        self._mode = "decode"
        self._n = positions.shape[0]
        self._row_index = (row_index if row_index is not None
                           else torch.arange(self._n, device=self.device))
        self._positions = positions
        self._kv_len = kv_len

    # -- the transformers hook -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "prefill":
            length = key_states.shape[2]
            keys[self._rows, :, :length] = key_states
            values[self._rows, :, :length] = value_states
            # Right padding: each row's valid queries see only its own valid, causal keys.
            return key_states, value_states
        if self._mode == "decode":
            keys[self._row_index, :, self._positions] = key_states[:, :, 0]
            values[self._row_index, :, self._positions] = value_states[:, :, 0]
            return keys[: self._n, :, : self._kv_len], values[: self._n, :, : self._kv_len]
        raise RuntimeError("SlotKVCache.update called outside a prefill or decode step")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Only consulted by models when no position_ids are given; the engine always gives them."""
        return 0
