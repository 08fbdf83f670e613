"""A plain PyTorch GRPO loop run as an rlix pipeline through rlix.client: the four hooks on their
own, with no rlix internals. rlix starts this program for the pipeline named in
examples/external_loop/config.yaml, serves its generation from the pipeline's shards (through
the router at `info.base_url`), and moves its GPUs and weights between the hooks.

The task: make the model say one character. Each step samples GROUPS prompts x GROUP_SIZE
completions, rewards each by the share of its tokens that are the target, and takes one
policy-gradient step with group-normalised advantages (GRPO without clipping: one update per
batch, so the policy that sampled is the one trained).

    rlix run examples/external_loop/config.yaml
"""

from __future__ import annotations

import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlix.client

GROUPS = int(os.environ.get("LOOP_GROUPS", "4"))
GROUP_SIZE = int(os.environ.get("LOOP_GROUP_SIZE", "4"))
MAX_TOKENS = int(os.environ.get("LOOP_MAX_TOKENS", "12"))
LR = float(os.environ.get("LOOP_LR", "3e-3"))
TARGET = os.environ.get("LOOP_TARGET", "z")


def sample_group(http: httpx.Client, prompt: list[int]) -> list[list[int]]:
    """GROUP_SIZE completions of one prompt, from whichever shard holds GPUs now."""
    body = {"token_ids": prompt, "sampling_params": {"n": GROUP_SIZE, "max_tokens": MAX_TOKENS,
                                                     "temperature": 1.0, "ignore_eos": True}}
    answer = http.post("/inference/v1/generate", json=body)
    answer.raise_for_status()
    return [c["token_ids"] for c in answer.json()["choices"]]


def response_logprob(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Sum of log pi(response token | what came before) under the model being trained."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=device)[:, None]).sum().cpu()


def main() -> int:
    client = rlix.client.connect()
    info = client.info
    print(f"pipeline {info.name}: router {info.base_url}, model {info.model_path}, {info.steps} steps", flush=True)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(info.model_path)
    # on real GPUs the model trains on the one rlix grants (the only one this process sees)
    model = AutoModelForCausalLM.from_pretrained(info.model_path, dtype=torch.float32).to(
        "cuda" if info.device == "cuda" else "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    target = tokenizer.encode(TARGET, add_special_tokens=False)[0]
    prompts = [tokenizer.encode(f"say {TARGET} {i}", add_special_tokens=False) for i in range(64)]
    rng = random.Random(0)
    client.start(model, optimizer=optimizer)  # version 0; on CUDA the state leaves the GPU until granted
    headers = {"Authorization": f"Bearer {info.api_key}"}
    with httpx.Client(base_url=info.base_url, headers=headers, timeout=600) as http, \
            ThreadPoolExecutor(GROUPS) as pool:
        for step in range(info.steps):
            batch = [rng.choice(prompts) for _ in range(GROUPS)]
            client.report_progress(0, GROUPS * GROUP_SIZE)
            groups = list(pool.map(lambda p: (p, sample_group(http, p)), batch))
            client.report_progress(GROUPS * GROUP_SIZE, GROUPS * GROUP_SIZE)
            client.before_training(step)  # the scheduler frees the training GPUs
            optimizer.zero_grad()
            rewards, loss_sum = [], 0.0
            for prompt, responses in groups:
                scores = torch.tensor([sum(t == target for t in r) / max(len(r), 1) for r in responses])
                rewards += scores.tolist()
                advantages = (scores - scores.mean()) / (scores.std() + 1e-4)
                for response, advantage in zip(responses, advantages):
                    if response and advantage != 0:
                        loss = -advantage * response_logprob(model, prompt, response) / len(response)
                        (loss / (GROUPS * GROUP_SIZE)).backward()
                        loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            reward = sum(rewards) / len(rewards)
            done = client.after_training(step, model, metrics={"reward": reward, "loss": loss_sum},
                                         next_batch=(0, GROUPS * GROUP_SIZE))
            print(f"step {step + 1}: reward {reward:.3f}, version {done.version}, refit {done.refit}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
