"""One GRPO train step of the trainer on a GPU: a batch of long-tailed response lengths against
one of fixed lengths, with the micro-batches of today (samples grouped by length, up to the
padded-token budget) and in the batch's order (`micro_batch_size` samples each, as before).

RL's response lengths are long-tailed; a micro-batch is padded to its longest sample, so the
way samples are put together decides how many tokens the step computes. Each case is timed over
`--steps` steps after one untimed step (kernels and allocator warm), whole `train_step` calls:

  fixed_tokens_per_s            every sample --max-tokens long (the mix workload's long pipelines)
  longtail_tokens_per_s         lengths drawn from a lognormal (median --median, sigma --sigma,
                                capped at --max-tokens), grouped by length (the trainer's way)
  longtail_batch_order_tokens_per_s   the same batch, micro-batches in the batch's order
  longtail_speedup              longtail_tokens_per_s / longtail_batch_order_tokens_per_s
  longtail_after_reload_step_s  the grouped longtail step right after an offload and a reload
                                (what a pipeline's trainer does before every step)
Tokens are response tokens trained (what the step's loss covers), per second of train_step.

    python3 bench/trainer_step.py [--model qwen2-0.5b-shape] [--samples 256] [--micro 8]
                                  [--steps 3] [--device cuda]
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from rlix.training.trainer import PolicyTrainer
from rlix.training.types import TrainSample


def batch(n: int, lengths: list[int], prompt: int, vocab: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, vocab) for _ in range(prompt)]
        r = [rng.randrange(1, vocab) for _ in range(lengths[i])]
        out.append(TrainSample(p, r, [-2.0] * len(r), rng.uniform(-1, 1), 0))
    return out


def batch_order(trainer: PolicyTrainer):  # type: ignore[no-untyped-def]
    """Micro-batches of `micro_batch_size` samples in the batch's order (the way before)."""
    def chunks(samples: Sequence[TrainSample]) -> Iterator[list[int]]:
        for i in range(0, len(samples), trainer.micro_batch_size):
            yield list(range(i, min(i + trainer.micro_batch_size, len(samples))))
    return chunks


def timed(trainer: PolicyTrainer, samples: list[TrainSample], steps: int, offload: bool = False) -> float:
    """Median seconds of `steps` train steps, after one untimed. `offload`: the trainer's state
    goes to the host and back before each (untimed), as a time-shared or colocated pipeline's
    trainer does between its steps (the GPU memory given back to the driver each time)."""
    trainer.train_step(samples)
    took = []
    for _ in range(steps):
        if offload:
            trainer.offload()
            trainer.reload()
        torch.cuda.synchronize() if trainer.device.type == "cuda" else None
        t0 = time.perf_counter()
        trainer.train_step(samples)
        torch.cuda.synchronize() if trainer.device.type == "cuda" else None
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens per sample")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--median", type=float, default=64)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trainer = PolicyTrainer(args.model, device=args.device, micro_batch_size=args.micro, lr=1e-6)
    vocab = min(trainer.vocab_size, 30000)
    rng = random.Random(0)
    tail = [max(8, min(args.max_tokens, round(rng.lognormvariate(math.log(args.median), args.sigma))))
            for _ in range(args.samples)]
    fixed = batch(args.samples, [args.max_tokens] * args.samples, args.prompt, vocab, 1)
    longtail = batch(args.samples, tail, args.prompt, vocab, 2)
    tokens_fixed, tokens_tail = sum(len(s.response_ids) for s in fixed), sum(tail)
    out: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "model": args.model, "samples": args.samples, "micro_batch_size": args.micro,
                 "longtail_tokens": tokens_tail, "longtail_max": max(tail),
                 "longtail_micro_batches": len(list(trainer._chunks(longtail)))}
    s_fixed = timed(trainer, fixed, args.steps)
    s_tail = timed(trainer, longtail, args.steps)
    s_tail_offload = timed(trainer, longtail, args.steps, offload=True)
    trainer._chunks = batch_order(trainer)  # type: ignore[method-assign]
    s_order = timed(trainer, longtail, args.steps)
    out.update({"fixed_step_s": round(s_fixed, 3), "longtail_step_s": round(s_tail, 3),
                "longtail_batch_order_step_s": round(s_order, 3),
                "longtail_after_reload_step_s": round(s_tail_offload, 3),
                "fixed_tokens_per_s": round(tokens_fixed / s_fixed), "longtail_tokens_per_s": round(tokens_tail / s_tail),
                "longtail_batch_order_tokens_per_s": round(tokens_tail / s_order),
                "longtail_speedup": round(s_order / s_tail, 3), "wall_s": round(time.perf_counter() - t0, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
