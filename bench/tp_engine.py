"""The embedded engine split over `--tp` GPUs against the same engine on one, in one run
(issue 37, acceptance 3's second half): same model, same prompts, same requests.

For each engine, one after the other on the same machine:
  load_s            from_pretrained to ready (the other ranks' processes started, slices loaded)
  greedy            32 prompts of 8-64 random tokens, 64 greedy tokens each; the tp engine's
                    outputs against one GPU's: `greedy_equal` (fraction of identical outputs) and
                    `first_divergence_median` (position of the first differing token, over the
                    outputs that differ: bf16 sums taken in another order can flip a near tie)
  prompt logprobs   every prompt token's logprob from the prefill: `prompt_logprob_max_abs_diff`
                    and `_mean_` between the two engines, and the same between the one-GPU engine
                    and transformers' own forward of the model it serves (`hf_vs_tp1_...`): the
                    spread two correct bf16 implementations of one model show, the tolerance
                    the tp engine's spread is read against (`tp_vs_hf_spread`: its mean over
                    theirs)
  tok_s_c32/_c256   generated tokens per second with at most 32 / 256 requests in flight
                    (prompts 8-64 tokens, 32-128 new tokens, temperature 1), prefill included

    python3 bench/tp_engine.py [--model qwen2.5-7b-shape] [--tp 2]
(`--device cpu --model tiny --dtype float32` checks the script itself.) Ends by printing one JSON
line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import engine_run, make_requests  # noqa: E402
from benchlib.benchkit import log  # noqa: E402

GREEDY_PROMPTS, GREEDY_TOKENS = 32, 64


async def greedy(engine: TorchEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    async def one(i: int, prompt: list[int]) -> tuple[list[int], list[float]]:
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        last = None
        async for last in engine.generate(f"greedy-{i}", prompt, params, final_only=True):
            pass
        assert last is not None and last.prompt_logprobs is not None
        return last.token_ids, [v for v in last.prompt_logprobs if v is not None]
    done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [d[0] for d in done], [d[1] for d in done]


@torch.inference_mode()
def hf_prompt_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (from the second on) by transformers' forward of `model`."""
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def spread(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """(max, mean) absolute difference of two sets of prompt logprobs."""
    diffs = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return max(diffs), statistics.fmean(diffs)


def measure(args: argparse.Namespace, tp: int, vocab_prompts: list[list[int]]) -> dict:
    t = time.perf_counter()
    engine = TorchEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, max_num_seqs=256,
                                         tensor_parallel_size=tp)
    load_s = time.perf_counter() - t
    log(f"tp={tp}: loaded in {load_s:.1f} s")
    try:
        tokens, logprobs = asyncio.run(greedy(engine, vocab_prompts))
        figures = {"load_s": round(load_s, 1), "tokens": tokens, "logprobs": logprobs}
        if tp == 1:
            figures["hf_logprobs"] = hf_prompt_logprobs(engine.model, vocab_prompts)
        for c in args.concurrency:
            requests = make_requests(3 * c, engine.vocab_size, seed=c)
            figures[f"tok_s_c{c}"] = round(asyncio.run(engine_run(engine, requests, c)), 1)
            log(f"tp={tp}: c={c} {figures[f'tok_s_c{c}']} tok/s")
    finally:
        engine.close()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b-shape")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        sys.exit(f"tp_engine: tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    prompts = [p.prompt for p in make_requests(GREEDY_PROMPTS, 300, seed=7)]  # ids every preset has
    one, split = measure(args, 1, prompts), measure(args, args.tp, prompts)
    differ = [next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
              for x, y in zip(one["tokens"], split["tokens"]) if x != y]
    tp_max, tp_mean = spread(one["logprobs"], split["logprobs"])
    hf_max, hf_mean = spread(one["logprobs"], one["hf_logprobs"])
    figures = {
        "bench": "tp_engine", "model": args.model, "tp": args.tp, "device": args.device, "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "greedy_equal": round(1 - len(differ) / len(prompts), 3),
        "first_divergence_median": statistics.median(differ) if differ else None,
        "prompt_logprob_max_abs_diff": round(tp_max, 4),
        "prompt_logprob_mean_abs_diff": round(tp_mean, 5),
        "hf_vs_tp1_logprob_max_abs_diff": round(hf_max, 4),
        "hf_vs_tp1_logprob_mean_abs_diff": round(hf_mean, 5),
        "tp_vs_hf_spread": round(tp_mean / hf_mean, 2) if hf_mean else None,
        "load_s_tp1": one["load_s"], f"load_s_tp{args.tp}": split["load_s"],
    }
    for c in args.concurrency:
        figures[f"tok_s_c{c}_tp1"] = one[f"tok_s_c{c}"]
        figures[f"tok_s_c{c}_tp{args.tp}"] = split[f"tok_s_c{c}"]
        figures[f"tp{args.tp}_vs_tp1_c{c}"] = round(split[f"tok_s_c{c}"] / one[f"tok_s_c{c}"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
