"""The defaults learn: GRPO on the tiny preset raises a trivial reward within 30 steps on CPU.

Samples come from the trainer's own model (plain ancestral sampling), reward 1 for a response
that contains a token of a fixed target set, group-relative advantages over 8 samples of each
prompt. This is the check that the default lr suits a tiny model.
"""

from __future__ import annotations

import time

import torch

from rlix.training.grpo import group_advantages
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import TrainSample

PROMPTS, GROUP, RESPONSE_LEN, STEPS = 8, 8, 4, 30


def target(token: int) -> bool:
    return token % 16 == 3


@torch.no_grad()
def sample(trainer: PolicyTrainer, prompts: torch.Tensor, gen: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [N, R] and their logprobs under the sampling policy (temperature 1)."""
    seq, logps = prompts, []
    for _ in range(RESPONSE_LEN):
        logits = trainer.model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        logps.append(logp.gather(-1, tok))
        seq = torch.cat([seq, tok], dim=1)
    return seq[:, prompts.shape[1]:], torch.cat(logps, dim=1)


def run(trainer: PolicyTrainer, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 300, (PROMPTS, 4), generator=gen).repeat_interleave(GROUP, dim=0)
    means = []
    for _ in range(steps):
        responses, logps = sample(trainer, prompts, gen)
        rewards = torch.tensor([[float(any(target(t) for t in r)) for r in responses.tolist()]]
                               ).view(PROMPTS, GROUP)
        adv = group_advantages(rewards).reshape(-1)
        batch = [TrainSample(p, r, lp, float(a), trainer.step)
                 for p, r, lp, a in zip(prompts.tolist(), responses.tolist(), logps.tolist(), adv.tolist())]
        trainer.train_step(batch)
        means.append(rewards.mean().item())
    return means


def test_thirty_grpo_steps_raise_the_mean_reward(tiny_model_dir):
    torch.manual_seed(0)
    trainer = PolicyTrainer(str(tiny_model_dir), micro_batch_size=32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster on a busy host
    try:
        started = time.perf_counter()
        means = run(trainer, STEPS)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    print(f"mean reward {first:.2f} -> {last:.2f} in {seconds:.1f}s: {[round(m, 2) for m in means]}")
    assert last - first > 0.3, means
    assert seconds < 60
