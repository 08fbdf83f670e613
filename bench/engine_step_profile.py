"""Where one decode step of the embedded engine goes on this CPU (issue 20's profile).

In-process, on the engine's own pieces (ModelRunner, sample) with the given model, dtype and
thread count, for batch sizes 1, 8 and 32 after a 36-token prefill each:
  forward_ms     ModelRunner.decode (24 decoder layers + LM head), median of the steps
  lm_head_ms     of it, the LM head alone on the same hidden rows
  sample_ms      sample() of that step's logits (temperature 1)
  ops            torch.profiler's top ops by self CPU time over a few decode steps
  linear_*_ms    every decoder Linear at this batch (biases left out), three ways: torch's bf16
                 F.linear (what the engine runs), the same weights reordered once for oneDNN
                 (as inductor and vLLM's CPU backend do), and fp32 F.linear
  forward_onednn_reordered_ms  the forward again with every decoder Linear swapped (in this
                 process) for one on weights reordered once for oneDNN: the projection
  engine_tok_s   TorchEngine in-process (no HTTP) at c concurrent, to compare with the server
Prints a readable report on stderr and one JSON line on stdout. Nothing of the engine is changed.

    .venv/bin/python bench/engine_step_profile.py [--model qwen2-0.5b-shape] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.inference.engine.sampling import RowSampling, new_rng, sample
from rlix.models.presets import resolve_model

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from engine_throughput import engine_run, make_requests  # noqa: E402  (same workload helpers)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of fn() over reps calls (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


@torch.inference_mode()
def step_breakdown(runner: ModelRunner, n: int, steps: int, vocab: int) -> dict:
    prompt_len = 36
    runner.cache.ensure_capacity(prompt_len + steps + 8, live_rows=0, live_len=0)
    runner.prefill([[5 + (i + j) % (vocab - 5) for j in range(prompt_len)] for i in range(n)], 0)
    rows = [RowSampling(1.0, 0, 1.0, new_rng(i)) for i in range(n)]
    tokens, fwd, smp = [7] * n, [], []
    for s in range(steps):
        pos = [prompt_len + s] * n
        t0 = time.perf_counter()
        logits = runner.decode(tokens, pos)
        t1 = time.perf_counter()
        tokens = sample(logits, rows).tokens
        t2 = time.perf_counter()
        fwd.append((t1 - t0) * 1000)
        smp.append((t2 - t1) * 1000)
    hidden = torch.randn(n, runner.lm_head.weight.shape[1], dtype=runner.dtype)
    head = timed(lambda: runner.lm_head(hidden), 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(3):
            runner.decode(tokens, [prompt_len + steps - 3 + s] * n)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"forward_ms": round(statistics.median(fwd), 2), "lm_head_ms": round(head, 2),
            "sample_ms": round(statistics.median(smp), 2),
            "ops_self_cpu_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in ops}}


@torch.no_grad()
def linear_compare(model: torch.nn.Module, n: int) -> dict:
    """Every decoder Linear of the model at batch n (all layers: their weights stream from
    memory as in a real step), three ways: bf16 `F.linear` as served, the same weights reordered
    once for oneDNN (`_reorder_linear_weight` + `_linear_pointwise`, what inductor emits for
    frozen CPU linears, and the way vLLM's CPU backend prepacks), and fp32 `F.linear`."""
    weights = [m.weight for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=torch.bfloat16) for w in weights}
    bf16 = [w.to(torch.bfloat16) for w in weights]
    out = {"linear_bf16_ms": timed(lambda: [F.linear(xs[w.shape[1]], w) for w in bf16], 5)}
    try:
        packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w, n)) for w in bf16]
        out["linear_bf16_onednn_reordered_ms"] = timed(
            lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "") for k, p in packed], 5)
        del packed
    except (RuntimeError, AttributeError) as exc:  # a torch build without oneDNN bf16
        say(f"  no oneDNN reordered linear here: {exc}")
    fp32 = [w.float() for w in weights]
    xs32 = {k: x.float() for k, x in xs.items()}
    out["linear_fp32_ms"] = timed(lambda: [F.linear(xs32[w.shape[1]], w) for w in fp32], 3)
    return {k: round(v, 2) for k, v in out.items()}


class ReorderedLinear(torch.nn.Module):
    """A bf16 Linear on weights reordered once for oneDNN: swapped into this process's model
    only, to project what the engine's decode step would take with such weights."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
        self.bias = None if lin.bias is None else lin.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def reorder_linears(model: torch.nn.Module) -> None:
    for layer in model.get_decoder().layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, ReorderedLinear(child))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model, _ = load_model(path, torch.device("cpu"), getattr(torch, args.dtype))
    runner = ModelRunner(model, device=torch.device("cpu"), num_rows=32, max_model_len=256)
    vocab = runner.vocab_size
    result: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    for n in (1, 8, 32):
        row = step_breakdown(runner, n, args.steps, vocab)
        row.update(linear_compare(model, n))
        result[f"batch{n}"] = row
        say(f"batch {n}: {json.dumps(row)}")
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        reorder_linears(model)
        for n in (1, 8, 32):
            fwd = step_breakdown(runner, n, args.steps, vocab)["forward_ms"]
            result[f"batch{n}"]["forward_onednn_reordered_ms"] = fwd
            say(f"batch {n}, Linears on oneDNN-reordered weights: forward {fwd} ms")
    del runner, model
    if not args.no_engine:
        engine = TorchEngine.from_pretrained(args.model, dtype=args.dtype, max_num_seqs=32, max_model_len=256)
        asyncio.run(engine_run(engine, make_requests(2, engine.vocab_size, 99), 2))
        for c, n in ((1, 2), (8, 8)):
            reqs = [r.__class__(r.prompt, 128) for r in make_requests(n, engine.vocab_size, c)]
            result[f"engine_tok_s_c{c}"] = round(asyncio.run(engine_run(engine, reqs, c)), 2)
            say(f"engine in-process c={c}: {result[f'engine_tok_s_c{c}']} tok/s")
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
