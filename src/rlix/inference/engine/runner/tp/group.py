"""The processes of a tensor-parallel engine: rank 0 (the engine's own process) and the
`size - 1` workers it starts, one per further device.

Rank 0 runs the whole engine (scheduling, sampling, the server); a worker runs only a model
runner over its slices (tp/worker.py) and makes, in the same order, every call rank 0's runner
makes (tp/runner.py), so that the forwards meet in the same all-reduces. Calls travel as pickled
`Call`s over each worker's stdin, answers (`Reply`, only for calls that ask for one) over its
stdout: private pipes between processes of one user, no port and no secret. The collectives run
on a process group made apart from torch.distributed's default one (NCCL on CUDA, gloo on the
CPU), over a TCPStore rendezvous bound to 127.0.0.1.

Lifetimes: a worker ends when its stdin closes, when rank 0's process is gone (it polls its
parent), or on `Op.EXIT`; `close()` ends each by its PID after a grace period. Rank 0 watches
its workers: one that exits while the group is open fails the group (`failure`), and the next
call raises EngineStateError naming the rank, its PID and exit code, so the shard is replaced
instead of hanging in a collective (an NCCL group is aborted; gloo's collectives fail by
themselves when a peer's connection drops).
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rlix.errors import ConfigError, EngineStateError
from rlix.inference.engine.runner.tp.plan import ShardPlan, TensorParallel
from rlix.models.slices import row_reader
from rlix.tcp_store import join_store, serve_store
from rlix.weights.wire import ShmSegment

log = logging.getLogger(__name__)

#: how long the ranks wait for each other to form the group: a worker joins first thing (before
#: it loads its slices), so a rank missing after this is a rank that failed to start
JOIN_TIMEOUT_S = 120.0
#: the module a worker runs (`python -m`)
WORKER_MODULE = "rlix.inference.engine.runner.tp.worker"
#: a collective that waits longer fails the group (a peer hung or gone)
COLLECTIVE_TIMEOUT_S = 600.0
#: how long a worker has to exit after Op.EXIT before it is killed
EXIT_GRACE_S = 10.0
WATCH_S = 0.5
_HEADER = struct.Struct("<Q")
_ALIGN = 64  # bytes: every tensor in a SharedTensors file starts at a multiple


class Op(Enum):
    """What rank 0 asks of a worker: one per verb of ModelRunner that changes device state."""

    PREFILL = "prefill"
    LAUNCH = "launch"
    DECODE = "decode"
    CAPTURE = "capture"
    ALLOCATE = "allocate"
    ENSURE_CAPACITY = "ensure_capacity"
    COPY_ROWS = "copy_rows"
    MOVE_ROWS = "move_rows"
    KEEP_ROWS = "keep_rows"
    LOAD_ROWS = "load_rows"
    FORGET_ROWS = "forget_rows"
    FREE_FOR_SLEEP = "free_for_sleep"
    RELEASE_MEMORY = "release_memory"
    WAKE = "wake"
    OPEN_UPDATE = "open_update"
    STAGE = "stage"
    ABANDON_UPDATE = "abandon_update"
    COMMIT_UPDATE = "commit_update"
    CHECKSUMS = "checksums"
    MEASURE = "measure"
    EXIT = "exit"


@dataclass(frozen=True)
class Call:
    op: Op
    args: tuple[Any, ...] = ()
    reply: bool = False


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: Any = None
    error: str = ""


@dataclass(frozen=True)
class RunnerOptions:
    """The ModelRunner settings every rank is built with."""

    num_rows: int
    max_model_len: int
    kv_initial_capacity: int
    cuda_graphs: bool
    fused: bool | None
    virtual_memory: bool | None


@dataclass(frozen=True)
class RankSpec:
    """What a worker needs to build its runner: its place, its device, the model and the
    rendezvous (the first message on its stdin)."""

    rank: int
    size: int
    device: str
    model_path: str
    dtype: str | None  # a torch dtype's name; None: the checkpoint's
    store_port: int
    options: RunnerOptions
    backend: str = field(default="gloo")


@dataclass(frozen=True)
class SharedTensors:
    """Full tensors of a weight update, handed to the workers in one private shared-memory file
    (rank 0 writes it once, every worker maps it and keeps its slices): (name, dtype, shape,
    byte offset) per tensor."""

    segment: str
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]

    @staticmethod
    def pack(named: dict[str, torch.Tensor]) -> tuple[SharedTensors, ShmSegment]:
        entries, offset = [], 0
        for name, tensor in named.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            entries.append((name, tensor.dtype, tuple(tensor.shape), offset))
            offset += tensor.numel() * tensor.element_size()
        segment = ShmSegment.create(max(offset, 1), prefix="rlix-tp")
        for (name, dtype, shape, at), tensor in zip(entries, named.values()):
            nbytes = tensor.numel() * tensor.element_size()
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            segment.tensor[at: at + nbytes].copy_(raw)  # from a GPU: one device-to-host copy
        return SharedTensors(segment.name, tuple(entries)), segment

    @contextmanager
    def open(self) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors, as views of the mapped file (valid inside the block only)."""
        segment = ShmSegment.attach(self.segment)
        try:
            yield {name: segment.tensor[at: at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                   for name, dtype, shape, at in self.entries}
        finally:
            segment.close()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the r-th CUDA device from rank 0's (a shard sees its own GPUs only), or
    the CPU for every rank."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ConfigError(f"tensor parallelism runs on CUDA or the CPU, not {device}")
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ConfigError(f"tensor parallel size {size} from {device} needs {first + size} visible "
                          f"CUDA devices; {count} are visible")
    return [torch.device("cuda", first + r) for r in range(size)]


def make_group(backend: str, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """The group's collectives, made from the store alone (not torch.distributed's default
    group) and checked with one all-reduce, waiting JOIN_TIMEOUT_S for the other ranks at most
    (a DistStoreError, a RuntimeError, after that); its collectives then wait
    COLLECTIVE_TIMEOUT_S."""
    prefixed = dist.PrefixStore("rlix-tp/", store)
    joining, working = timedelta(seconds=JOIN_TIMEOUT_S), timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = working  # its rendezvous is the probe's, through the store (JOIN_TIMEOUT_S)
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        probe = torch.ones(1, dtype=torch.float32, device="cuda")  # not the default dtype: a
        # model loading beside this (rank 0 loads its slices meanwhile) may have changed it
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, joining)  # connects to every rank here
        probe = torch.ones(1, dtype=torch.float32)
    TensorParallel(rank, size, group).all_reduce(probe)  # NCCL makes its communicator here, not in a graph
    if backend != "nccl":
        group._set_default_timeout(working)
    seen = probe.item()
    if seen != size:
        raise EngineStateError(f"tensor parallel group check on rank {rank} ({probe.device}): all-reduce gave "
                               f"{seen}, not {size}")
    return group


def write_message(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        return None
    return pickle.loads(data)


class RankGroup:
    """Rank 0's side: the worker processes, their pipes and the process group (module
    docstring). Built complete: the constructor returns once every worker has joined."""

    def __init__(self, device: torch.device, size: int, model_path: str, dtype: torch.dtype | None,
                 options: RunnerOptions) -> None:
        if size < 2:
            raise ConfigError(f"a tensor-parallel group needs size >= 2, got {size}")
        self.size = size
        self.devices = rank_devices(device, size)
        self.backend = backend_for(device)
        self.failure: str | None = None
        self._lock = threading.Lock()  # one writer at a time on the pipes (staging runs off-thread)
        self._closing = False
        self._procs: list[subprocess.Popen[bytes]] = []
        self._store = serve_store("127.0.0.1", 0, size, JOIN_TIMEOUT_S, wait_for_workers=False)
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
        try:
            for rank in range(1, size):
                spec = RankSpec(rank, size, str(self.devices[rank]), model_path, dtype_name,
                                self._store.port, options, self.backend)
                proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._procs.append(proc)
                assert proc.stdin is not None
                write_message(proc.stdin, spec)
            if self.backend == "nccl":
                torch.cuda.set_device(self.devices[0])
            try:
                self.group = make_group(self.backend, self._store, 0, size)
            except RuntimeError as exc:  # a rank never joined: say which, and why if it exited
                raise EngineStateError(self.poll() or f"the tensor parallel group did not form within "
                                       f"{JOIN_TIMEOUT_S:g} s: {exc}") from None
            self._watcher = threading.Thread(target=self._watch, name="rlix-tp-watch", daemon=True)
            self._watcher.start()
            for rank in range(1, size):
                self._expect(rank)  # "ready": the worker built its runner
        except BaseException:
            self.close()
            raise
        self.tp = TensorParallel(0, size, self.group)

    @property
    def pids(self) -> list[int]:
        """The workers' PIDs, rank 1 first."""
        return [p.pid for p in self._procs]

    def _watch(self) -> None:
        while not self._closing:
            self.poll()
            time.sleep(WATCH_S)

    def poll(self) -> str | None:
        """Look at the workers now: the group's failure (module docstring), None while all run."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None and not self._closing and self.failure is None:
                self.failure = f"tensor parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                log.error("%s; the engine cannot go on", self.failure)
                if self.backend == "nccl":
                    try:
                        self.group.abort()  # a collective waiting on it fails instead of hanging
                    except (RuntimeError, AttributeError):
                        pass
        return self.failure

    def _check(self) -> None:
        if self.failure is not None:
            raise EngineStateError(self.failure)

    def call(self, op: Op, *args: Any, reply: bool = False) -> list[Any]:
        """Send `op` to every worker; with `reply`, wait for each one's answer (its values, rank 1
        first) and raise the first worker's error as EngineStateError."""
        self._check()
        message = Call(op, args, reply)
        with self._lock:
            for rank, proc in enumerate(self._procs, start=1):
                assert proc.stdin is not None
                try:
                    write_message(proc.stdin, message)
                except (BrokenPipeError, OSError):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(EXIT_GRACE_S)  # its pipe closed: it is exiting, its code names why
                    self.failure = self.poll() or f"tensor parallel rank {rank} (pid {proc.pid}) is gone"
                    raise EngineStateError(self.failure) from None
            if not reply:
                return []
            return [self._expect(rank) for rank in range(1, self.size)]

    def _expect(self, rank: int) -> Any:
        proc = self._procs[rank - 1]
        assert proc.stdout is not None
        answer = read_message(proc.stdout)
        if not isinstance(answer, Reply):
            code = proc.poll()
            self.failure = self.failure or (f"tensor parallel rank {rank} (pid {proc.pid}) ended without "
                                            f"answering (exit code {code})")
            raise EngineStateError(self.failure)
        if not answer.ok:
            raise EngineStateError(f"tensor parallel rank {rank}: {answer.error}")
        return answer.value

    def close(self) -> None:
        """End every worker (Op.EXIT, then SIGKILL by PID after EXIT_GRACE_S)."""
        self._closing = True
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    write_message(proc.stdin, Call(Op.EXIT))
                    proc.stdin.close()
                except (BrokenPipeError, OSError, ValueError):
                    pass
        deadline = time.monotonic() + EXIT_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()


def load_rank(path: Path, device: torch.device, dtype: torch.dtype | None, rank: int,
              size: int) -> torch.nn.Module:
    """The model with rank `rank`'s slices only, on `device`, read a slice at a time
    (models/slices.py: a column split reads only its rows, a row split its tensor's rows one
    tensor at a time): no process holds the whole model, on the host or on a device."""
    config = AutoConfig.from_pretrained(path)
    stored = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or stored, attn_implementation="sdpa")
    plan = ShardPlan.for_rank(config, rank, size)
    read = row_reader(path)
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    first: dict[int, tuple[torch.nn.Parameter, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
            first.setdefault(id(param), (param, f"{prefix}.{attr}" if prefix else attr))
    with torch.no_grad():
        for key, (param, name) in first.items():
            cut = plan.cut(name, tuple(param.shape))
            if cut is not None and cut[0] == 0:  # this rank's rows
                host = read(name, cut[1], cut[1] + cut[2])
            else:
                host = read(name, 0, param.shape[0])
                if cut is not None:  # a row split: this rank's columns
                    host = host.narrow(1, cut[1], cut[2])
            real = torch.nn.Parameter(host.to(param.dtype).to(device).contiguous(), requires_grad=False)
            for owner, attr in owners[key]:  # tied: every owner gets the one tensor
                setattr(owner, attr, real)
    decoder = model.get_decoder()
    with torch.device("cpu"):  # computed as a model built on the host computes it, then moved
        decoder.rotary_emb = type(decoder.rotary_emb)(config=model.config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"{path}: no values for {', '.join(left[:4])} when read in slices")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def start_split(folder: Path, device: torch.device, dtype: torch.dtype | None, size: int,
                options: RunnerOptions) -> tuple[torch.nn.Module, RankGroup]:
    """Rank 0's slices (loaded here, while the workers load theirs) and the group of the other
    ranks, started; a size that does not divide the model fails before anything starts."""
    ShardPlan.for_rank(AutoConfig.from_pretrained(folder), 0, size)
    with ThreadPoolExecutor(1, thread_name_prefix="rlix-tp-load") as pool:
        loading = pool.submit(load_rank, folder, device, dtype, 0, size)
        group = RankGroup(device, size, str(folder), dtype, options)
        try:
            return loading.result(), group
        except BaseException:
            group.close()
            raise


def join_group(spec: RankSpec) -> dist.ProcessGroup:
    """A worker's side of make_group."""
    store = join_store("127.0.0.1", spec.store_port, spec.size, JOIN_TIMEOUT_S)
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.device))
    return make_group(spec.backend, store, spec.rank, spec.size)
