"""TorchEngine: the embedded engine behind `EngineAPI`, asyncio outside, one model thread inside.

Threading model: a single daemon worker thread owns the model and all engine state (core.py).
Async methods hand it commands through a locked inbox; it runs them between two steps, so every
control operation lands at a token boundary, then posts results and per-request deltas back to
the caller's event loop with `call_soon_threadsafe` (torch releases the GIL while it computes,
so the loop stays responsive). Any event loop may call in; each request streams to the loop that
iterates it. Staging a weight update copies tensors on a helper thread, so decoding continues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer

from rlix.devices import DeviceMemory
from rlix.errors import ConfigError, EngineStateError, InvalidRequestError, WeightUpdateError
from rlix.inference.engine.api import GenerationOutput, PauseMode, SamplingParams
from rlix.inference.engine.constrained import GrammarCompiler, RowGrammar, grammar_after
from rlix.inference.engine.core import EngineCore
from rlix.inference.engine.runner.kv_cache import DEFAULT_INITIAL_CAPACITY
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.inference.engine.runner.tp.group import RankGroup, RunnerOptions, start_split
from rlix.inference.engine.runner.tp.runner import TensorParallelRunner
from rlix.inference.engine.prefix_cache import DEFAULT_BUDGET_BYTES
from rlix.inference.engine.outputs import copy_output, fold_delta, merge_delta, validate_request
from rlix.inference.engine.runner.profile import StepProfile
from rlix.inference.engine.sequence import Delta, PromptGroup, Sequence
from rlix.inference.engine.stats import EngineStats
from rlix.inference.engine.weights import WeightStaging
from rlix.models.presets import resolve_model
from rlix.threads import yield_cores_to_control

if TYPE_CHECKING:
    from rlix.weights.wire import Layout

log = logging.getLogger(__name__)


class _Stream:
    """Where the worker sends one request's deltas: a queue on the loop that iterates it.

    `final_only`: the worker folds the deltas itself and posts once, when the request ends,
    instead of waking the caller's loop every step (64 non-streamed requests cost that loop
    64 wake-ups per step, and control calls queued behind them)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, final_only: bool = False) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.final_only = final_only
        self.folded: dict[int, Delta] = {}  # by sample index; worker thread only


def _set_future(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (see module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, device: str | torch.device = "cpu",
                 max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_prefill_tokens: int = 4096, kv_initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
                 cuda_graphs: bool = True, fused: bool | None = None,
                 overlap_steps: bool | None = None, compute_threads: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
                 virtual_memory: bool | None = None, tp_group: RankGroup | None = None) -> None:
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        limit = _position_limit(model.config)
        self.max_model_len = int(max_model_len or limit or 2048)
        if limit is not None and self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {limit}")
        if max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        options = dict(device=self.device, num_rows=max_num_seqs, max_model_len=self.max_model_len,
                       kv_initial_capacity=kv_initial_capacity, cuda_graphs=cuda_graphs,
                       fused=fused, virtual_memory=virtual_memory)
        #: the model's forwards; rank 0 of a tensor-parallel group (`tp_group`: the other ranks'
        #: processes; `model` holds rank 0's slices) sends them to the other ranks too
        self._runner: ModelRunner = (TensorParallelRunner(model, tp_group, **options) if tp_group is not None
                                     else ModelRunner(model, **options))  # type: ignore[arg-type]
        runner = self._runner
        self.vocab_size = runner.vocab_size
        self._weights = runner.weights
        eos_ids = _eos_ids(model, tokenizer)
        #: compiles constrained requests' grammars (their library is loaded at the first one)
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, eos_ids)
        self._core = EngineCore(runner, tokenizer, max_num_seqs=max_num_seqs,
                                eos_ids=eos_ids,
                                max_prefill_tokens=max_prefill_tokens, overlap=overlap_steps,
                                prefix_cache_bytes=prefix_cache_bytes)
        self._core.on_prefilled = self._post_deltas
        self._cv = threading.Condition()
        # (command, future for its result, answer before the request deltas it produced)
        self._inbox: list[tuple[Callable[[], Any], asyncio.Future[Any] | None, bool]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._live_ids: set[str] = set()
        self._pending_adds = 0
        self._staging: WeightStaging | None = None
        self._staging_failure: str | None = None
        self._staging_lock = threading.Lock()
        self._closed = False
        #: torch CPU threads of the worker thread (None: as the constructing thread has them)
        self._compute_threads = compute_threads
        self._thread = threading.Thread(target=self._work, name="rlix-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | PathLike[str], device: str | torch.device = "cpu",
                        dtype: str | torch.dtype | None = None, max_num_seqs: int = 32,
                        max_model_len: int | None = None, tensor_parallel_size: int = 1,
                        **kwargs: Any) -> TorchEngine:
        """Load a preset name or a local checkpoint dir; dtype None/"auto" keeps the saved one.
        `tensor_parallel_size` > 1: the model is split over that many devices from `device` on
        (CUDA), or that many processes (CPU); this process is rank 0 and starts the others."""
        device = torch.device(device)
        if isinstance(dtype, str) and dtype != "auto":
            resolved = getattr(torch, dtype, None)
            if not isinstance(resolved, torch.dtype):
                raise ConfigError(f"unknown dtype {dtype!r}; use e.g. float32, bfloat16, auto")
            dtype = resolved
        folder = resolve_model(path)
        dtype = None if dtype == "auto" else dtype
        if tensor_parallel_size > 1:
            return cls._tensor_parallel(folder, device, dtype, tensor_parallel_size, max_num_seqs,
                                        max_model_len, **kwargs)
        model, tokenizer = load_model(folder, device, dtype)
        return cls(model, tokenizer, device=device, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, **kwargs)

    @classmethod
    def _tensor_parallel(cls, folder: Path, device: torch.device, dtype: torch.dtype | None, size: int,
                         max_num_seqs: int, max_model_len: int | None, **kwargs: Any) -> TorchEngine:
        """The other ranks started and rank 0's slices loaded (runner/tp/group.py: start_split)."""
        config = AutoConfig.from_pretrained(folder)
        options = RunnerOptions(num_rows=max_num_seqs,
                                max_model_len=int(max_model_len or _position_limit(config) or 2048),
                                kv_initial_capacity=kwargs.get("kv_initial_capacity", DEFAULT_INITIAL_CAPACITY),
                                cuda_graphs=kwargs.get("cuda_graphs", True), fused=kwargs.get("fused"),
                                virtual_memory=kwargs.get("virtual_memory"))
        model, group = start_split(folder, device, dtype, size, options)
        try:
            return cls(model, AutoTokenizer.from_pretrained(folder), device=device, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, tp_group=group, **kwargs)
        except BaseException:
            group.close()
            raise

    # -- status --------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The served transformers model (read-only use: baselines, checks)."""
        return self._core.runner.model

    @property
    def weight_version(self) -> int:
        return self._core.weight_version

    @property
    def overlapped_steps(self) -> int:
        """Decode steps launched before the step before them was read (core.py: overlap)."""
        return self._core.overlapped_steps

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens run through prefill forwards so far (a request's n samples count once)."""
        return self._core.prefill_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens whose keys and values came from the prefix cache instead of a prefill."""
        prefixes = self._core.prefixes
        return prefixes.hit_tokens if prefixes is not None else 0

    @property
    def prefix_queried_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache (0 without one)."""
        prefixes = self._core.prefixes
        return prefixes.queried_tokens if prefixes is not None else 0

    @property
    def prefix_caching(self) -> bool:
        """Whether finished rows' keys and values are kept for later prompts (core.py)."""
        return self._core.prefixes is not None

    @property
    def stats(self) -> EngineStats:
        """The engine's own measures for /metrics (stats.py); read-only from other threads."""
        return self._core.stats

    @property
    def max_num_seqs(self) -> int:
        return self._core.max_num_seqs

    def sleep_level(self) -> int:
        """0 awake; 1 asleep with its weights kept (offloaded); 2 asleep with them dropped."""
        if not self._core.sleeping:
            return 0
        return 1 if self._weights.loaded else 2

    def num_waiting_deferred(self) -> int:
        """Waiting requests held by a pause (admitted only after resume), not by a lack of
        free rows: vLLM's "deferred" waiting reason."""
        return self._core.num_deferred()

    @property
    def forked_prompt_tokens(self) -> int:
        """Prompt tokens of the samples that copied another sample's prefill (n > 1)."""
        return self._core.forked_prompt_tokens

    @property
    def forked_rows(self) -> int:
        """Samples that started from another sample's prefill (n > 1) instead of their own."""
        return self._core.forked_rows

    def sleep_report(self) -> dict:
        """What the last sleep took (ms per phase) and the CUDA graph captures so far: the
        part of a wake's cost paid later, in the first decode steps. With virtual memory
        (runner/vmm.py) a sleep may keep the graphs (`graphs_kept`): `resident_bytes` is what
        the process still held on the device once that sleep had released (torch's reserved
        memory, the kept graphs' pools included, plus mapped virtual memory; None on CPU), and
        `vmm_mapped_bytes` this engine's virtual memory still mapped then (0 when sound)."""
        core = self._core
        graphs = [g for g in (core.runner.graphs, core.runner.prefill_graphs) if g is not None]
        return {"sleep_phases_ms": dict(core.last_sleep_phases_ms),
                "graph_captures": sum(g.captures for g in graphs),
                "graph_capture_ms": round(sum(g.capture_s for g in graphs) * 1000, 1),
                "virtual_memory": core.runner.virtual,
                "graphs_kept": core.last_sleep_kept_graphs,
                "resident_bytes": core.last_sleep_resident_bytes,
                "vmm_mapped_bytes": core.last_sleep_mapped_bytes,
                # what the sleep gave back: the room this shard needs again (the hand-off check)
                "freed_bytes": core.last_sleep_freed_bytes}

    async def capture_graphs(self) -> None:
        """Capture the CUDA graphs now rather than during the first steps (idle engine only)."""
        def capture() -> None:
            if self._core.running:
                raise EngineStateError("capture_graphs needs an idle engine")
            self._core.runner.capture_graphs()
        await self._call(capture)

    @property
    def profile(self) -> StepProfile:
        """Per-phase step times (profile.py); read or reset it while the engine is idle."""
        return self._core.profile

    @property
    def last_sleep_freed_bytes(self) -> int:
        """Memory the last sleep really gave back: RSS drop on CPU, mem_get_info on CUDA."""
        return self._core.last_sleep_freed_bytes

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 while it sleeps)."""
        return self._core.runner.cache.nbytes()

    def weight_bytes(self) -> int:
        """Bytes of the served parameters (tied ones once)."""
        return sum(spec.numel * spec.dtype.itemsize for spec in self._weights.specs.values())

    def is_paused(self) -> bool:
        return self._core.pause_mode is not None

    def device_memory(self) -> DeviceMemory:
        """The engine's device memory, measured now: on a tensor-parallel engine the GPU of its
        group with the least free (what a hand-off must wait for)."""
        return self._runner.measure_memory()

    def failure(self) -> str | None:
        """Why this engine cannot serve any more (one of its tensor-parallel ranks is gone: the
        server's /health then fails, so the shard is replaced), None while it can."""
        return self._runner.failure()

    def is_sleeping(self) -> bool:
        return self._core.sleeping

    def num_running(self) -> int:
        return len(self._core.running)

    def num_waiting(self) -> int:
        return len(self._core.waiting) + self._pending_adds

    def kv_cache_usage(self) -> float:
        """Of the KV cache's room (a row of max_model_len positions per sequence slot), the
        fraction the running sequences fill now: vLLM's kv_cache_usage_perc for a slot cache."""
        rows = self._core.max_num_seqs * self.max_model_len
        used = sum(max(0, s.cached_len) for s in list(self._core.running))
        return min(1.0, used / rows) if rows else 0.0

    # -- the worker ----------------------------------------------------------------------
    def _submit(self, fn: Callable[[], Any], fut: asyncio.Future[Any] | None = None,
                answer_first: bool = False) -> None:
        with self._cv:
            if self._closed:
                raise EngineStateError("the engine is closed")
            self._inbox.append((fn, fut, answer_first))
            self._cv.notify()

    async def _call(self, fn: Callable[[], Any], answer_first: bool = False) -> Any:
        """Run fn on the worker between two steps and return its result here. The answer is
        posted before the next step runs; after the request deltas fn produced (a returned
        abort() was seen), unless `answer_first`."""
        fut = asyncio.get_running_loop().create_future()
        self._submit(fn, fut, answer_first)
        return await fut

    def _work(self) -> None:
        yield_cores_to_control(self.device)
        if self._compute_threads:
            torch.set_num_threads(self._compute_threads)
        core = self._core
        while True:
            with self._cv:
                while not self._inbox and not core.has_work() and not self._closed:
                    self._cv.wait()
                if self._closed and not self._inbox:
                    return
                commands, self._inbox = self._inbox, []
            results = []
            for fn, fut, first in commands:
                try:
                    results.append((fut, fn(), None, first))
                except Exception as exc:  # delivered to the caller, the engine carries on
                    results.append((fut, None, exc, first))
            if any(fut is not None for fut, *_ in results):
                self._deliver(results)  # a control call is answered now, not after a step
                results = []
            if core.has_work():
                core.step()
                started = time.perf_counter()
                self._deliver(results)
                core.profile.add("deliver", time.perf_counter() - started)
            else:
                self._deliver(results)

    def _deliver(self, results: list[tuple[asyncio.Future[Any] | None, Any, Exception | None, bool]]
                 ) -> None:
        """Post request deltas first, then command results, so a returned abort() was seen;
        results marked answer-first go ahead of the deltas (a sleep's caller should not wait
        while the loop hands out every request the sleep aborted)."""
        for fut, result, error, first in results:
            if first and fut is not None:
                self._post(fut.get_loop(), _set_future, fut, result, error)
        self._post_deltas()
        if self._drain_waiters and (self._core.pause_mode != "wait" or self._core.drained()):
            waiters, self._drain_waiters = self._drain_waiters, []
            results.extend((fut, None, None, False) for fut in waiters)
        for fut, result, error, first in results:
            if fut is not None and not first:
                self._post(fut.get_loop(), _set_future, fut, result, error)

    def _post_deltas(self) -> None:
        """Hand every request's new tokens to its caller's loop (also called mid-step by the
        core: a prefill's first tokens go out before that step's decode)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Delta]]] = {}
        for seq, delta in self._core.collect():
            sink = seq.sink
            if sink.final_only:
                sink.folded[delta.index] = delta = fold_delta(sink.folded.get(delta.index), delta)
                if delta.finish_reason is None and delta.error is None:
                    continue
            by_loop.setdefault(sink.loop, []).append((sink, delta))
        for loop, items in by_loop.items():
            self._post(loop, _put_all, items)

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop is closed: nobody listens to those requests any more
            if fn is _put_all:
                self._core.abort([sink.request_id for sink, _ in args[0]])

    def close(self) -> None:
        """Abort everything and stop the worker thread."""
        with self._cv:
            if self._closed:
                return
            self._inbox.append((lambda: self._core.abort(None), None, False))
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self._runner.close()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- generation ----------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, *, final_only: bool = False) -> AsyncIterator[GenerationOutput]:
        """Validate now (InvalidRequestError / EngineStateError raise at call), stream later.

        Each item is the cumulative state; the last has finish_reason set. With `final_only`
        only that last one comes (for callers that do not stream). Closing the iterator early
        (client gone) aborts the request. With `params.n` > 1 the items of the n samples come
        interleaved, told apart by `index`, until every sample has finished.
        """
        prompt = validate_request(request_id, prompt_token_ids, params, vocab_size=self.vocab_size,
                                  max_model_len=self.max_model_len,
                                  max_num_seqs=self._core.max_num_seqs)
        if request_id in self._live_ids:
            raise InvalidRequestError(f"request {request_id!r} is already running")
        if self._closed:
            raise EngineStateError("the engine is closed")
        self._core.check_can_generate()
        # a schema, regex or grammar that does not compile is refused here, before any work; so
        # are already generated tokens (a continuation's prompt tail) the grammar does not allow
        grammar = None
        if params.constraint is not None:
            generated = prompt[len(prompt) - params.already_generated:] if params.already_generated else []
            grammar = grammar_after(self.grammars.compile(params.constraint), generated, "already_generated")
        if params.n > 1:
            return self._stream_group(request_id, prompt, params, final_only, grammar)
        return self._stream(request_id, prompt, params, final_only, grammar)

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                      final_only: bool = False, grammar: RowGrammar | None = None
                      ) -> AsyncIterator[GenerationOutput]:
        if request_id in self._live_ids:
            raise InvalidRequestError(f"request {request_id!r} is already running")
        sink = _Stream(request_id, asyncio.get_running_loop(), final_only)
        seq = Sequence(request_id, prompt, params, sink=sink, fold=final_only, grammar=grammar)
        out = GenerationOutput(request_id=request_id, prompt_token_ids=prompt)
        self._live_ids.add(request_id)
        with self._cv:
            self._pending_adds += 1
        try:
            self._submit(lambda: self._add(seq))
            while True:
                delta = await sink.queue.get()
                error = merge_delta(out, delta)
                while error is None and not out.finished and not sink.queue.empty():
                    error = merge_delta(out, sink.queue.get_nowait())  # catch up on a slow reader
                if error is not None:
                    raise error
                yield copy_output(out)
                if out.finished:
                    return
        finally:
            self._live_ids.discard(request_id)
            if not out.finished and not self._closed:
                try:
                    self._submit(lambda: self._core.abort([request_id]))
                except EngineStateError:  # closed meanwhile: everything was aborted anyway
                    pass

    def _add(self, seq: Sequence) -> None:
        with self._cv:
            self._pending_adds -= 1
        try:
            self._core.add(seq)
        except Exception as exc:  # e.g. put to sleep between generate() and the worker
            self._core.reject(seq, exc)

    async def _stream_group(self, request_id: str, prompt: list[int], params: SamplingParams,
                            final_only: bool = False, grammar: RowGrammar | None = None
                            ) -> AsyncIterator[GenerationOutput]:
        """The n samples of one request: queued as one group (one prefill), yielded by index."""
        n = params.n
        ids = [f"{request_id}-{i}" for i in range(n)]
        if any(i in self._live_ids for i in (request_id, *ids)):
            raise InvalidRequestError(f"request {request_id!r} is already running")
        sink = _Stream(request_id, asyncio.get_running_loop(), final_only)
        group = PromptGroup(request_id)
        group.members = [Sequence(ids[i], prompt, params, sink=sink, index=i, group=group,
                                  fold=final_only, grammar=grammar) for i in range(n)]
        outs = [GenerationOutput(request_id=ids[i], prompt_token_ids=prompt, index=i)
                for i in range(n)]
        self._live_ids.update((request_id, *ids))
        with self._cv:
            self._pending_adds += n
        done = 0
        try:
            self._submit(lambda: self._add_group(group.members))
            while done < n:
                delta = await sink.queue.get()
                out = outs[delta.index]
                error = merge_delta(out, delta)
                if error is not None:
                    raise error
                done += out.finished
                yield copy_output(out)
        finally:
            self._live_ids.difference_update((request_id, *ids))
            if done < n and not self._closed:
                try:
                    self._submit(lambda: self._core.abort([request_id]))
                except EngineStateError:
                    pass

    def _add_group(self, seqs: list[Sequence]) -> None:
        with self._cv:
            self._pending_adds -= len(seqs)
        try:
            self._core.add_group(seqs)
        except Exception as exc:
            for seq in seqs:
                self._core.reject(seq, exc)

    # -- control -------------------------------------------------------------------------
    async def abort(self, request_ids: list[str] | None = None) -> int:
        ids = None if request_ids is None else list(request_ids)
        return int(await self._call(lambda: self._core.abort(ids)))

    async def pause(self, mode: PauseMode) -> None:
        """abort: end in-flight requests; wait: return once they finished; keep: freeze them.

        In every mode, requests that arrive while paused queue until resume().
        """
        await self._call(lambda: self._core.pause(mode))
        if mode == "wait":
            fut = asyncio.get_running_loop().create_future()
            self._submit(lambda: self._drain_waiters.append(fut))
            await fut

    async def resume(self) -> None:
        await self._call(self._core.resume)

    async def sleep(self, level: int) -> None:
        """Abort in-flight requests, free the KV cache, offload (1) or drop (2) the weights."""
        await self._call(lambda: self._core.sleep(level), answer_first=True)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda: self._core.wake_up(tags))

    # -- weight update -------------------------------------------------------------------
    def served_weights(self) -> dict[str, torch.Tensor]:
        """The served parameters by canonical name (read-only use: the weight audit)."""
        return {n: p.data for n, p in self._weights.params.items()}

    async def weight_checksums(self) -> dict[str, int]:
        """Per-tensor checksums of the served weights by canonical name (the weight audit). On
        one rank computed beside the steps; a tensor-parallel engine gathers its split tensors
        from every rank, between two steps (the gathers are collectives, ordered with the
        forwards)."""
        if self._runner.tp.size == 1:
            return await asyncio.to_thread(self._runner.weight_checksums)
        return await self._call(self._runner.weight_checksums)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Canonical parameter name -> (shape, dtype): lets a bucket receiver refuse a layout
        that does not fit this model before an update starts."""
        return self._runner.full_specs()

    async def start_weight_update(self, version: int, allow_partial: bool = False) -> None:
        """Open an update; allow_partial lets finish accept a subset of the parameters."""
        if not self._weights.on_device:
            raise EngineStateError("weights are asleep; wake_up(['weights']) before updating")
        with self._staging_lock:
            if self._staging is not None:
                raise EngineStateError("a weight update is already in progress; finish or abort it")
            self._staging = self._runner.open_update(int(version), allow_partial)
            self._staging_failure = None

    def weight_destination(self, name: str) -> torch.Tensor | None:
        """No staging tensor to assemble split tensors into: the receiver allocates one (the
        staging copy keeps the served weights untouched until finish)."""
        return None

    def adopt_layout(self, layout: Layout) -> bool:
        """Reloads (after a level-2 sleep) land in this bucket layout when it sends exactly the
        served parameters (weights.py: WeightStore); the shard's receiver asks once per layout."""
        with self._staging_lock:
            return self._staging is None and self._weights.adopt(layout)

    def weight_bucket(self, index: int) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None:
        """During a reload into the adopted layout: where bucket `index`'s bytes go, and the
        tensors they complete (hand that mapping to update_weights once copied); else None."""
        with self._staging_lock:
            staging = self._staging
            return None if staging is None else staging.bucket_target(index)

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate and stage a batch of tensors. On CUDA the copies are asynchronous and waited
        for at finish: the caller keeps the source bytes unchanged until finish or abort (rlix's
        senders hold the cache slot that long); on CPU they are copied at once. A mapping that
        weight_bucket handed out is already in place: only noted."""
        with self._staging_lock:
            if self._staging is not None and self._staging.take_landed(named_tensors):
                return
        await asyncio.to_thread(self._stage, dict(named_tensors))

    def _stage(self, named_tensors: dict[str, torch.Tensor]) -> None:
        with self._staging_lock:
            staging = self._require_staging()
            try:
                self._runner.stage(staging, named_tensors)
            except WeightUpdateError as exc:
                self._staging, self._staging_failure = None, str(exc)
                self._runner.abandon_update(staging)
                raise

    def _require_staging(self) -> WeightStaging:
        if self._staging is None:
            if self._staging_failure is not None:
                raise WeightUpdateError(f"the weight update was refused: {self._staging_failure}")
            raise EngineStateError("no weight update in progress; call start_weight_update first")
        return self._staging

    async def finish_weight_update(self) -> int:
        """Swap the staged weights in between two steps; return the new weight version."""
        with self._staging_lock:
            staging = self._require_staging()
            self._staging = None
        try:
            return int(await self._call(lambda: self._core.apply_update(staging)))
        except WeightUpdateError as exc:
            self._staging_failure = str(exc)
            self._runner.abandon_update(staging)
            raise

    async def abort_weight_update(self, reason: str) -> None:
        with self._staging_lock:
            if self._staging is not None:
                log.info("weight update to version %d aborted: %s", self._staging.version, reason)
                self._runner.abandon_update(self._staging)
            self._staging, self._staging_failure = None, None


def _position_limit(config: Any) -> int | None:
    """The model's context (max_position_embeddings), None where the config does not say."""
    return int(getattr(config, "max_position_embeddings", 0) or 0) or None


def _put_all(items: list[tuple[_Stream, Delta]]) -> None:
    for sink, delta in items:
        sink.queue.put_nowait(delta)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return ids
