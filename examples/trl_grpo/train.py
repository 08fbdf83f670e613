"""TRL's GRPOTrainer (trl from PyPI, unmodified) as an rlix pipeline: its generation is served
by the pipeline's shards, its optimizer steps run on the GPUs rlix grants, its weights are refit
into the shards through rlix (rlix.client.trl wires TRL's rollout_func and a callback).

The task: say "a". rlix starts this program for the `trl-grpo` pipeline of
examples/trl_grpo/config.yaml, beside rlix's own GRPO pipeline:

    rlix run examples/trl_grpo/config.yaml
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

import rlix.client
from rlix.client.trl import RlixTRL


def says_a(completions: list[str], **_: object) -> list[float]:
    """Share of a completion's characters that are 'a' (spaces left out)."""
    return [sum(c == "a" for c in text) / max(len(text.replace(" ", "")), 1) for text in completions]


def main() -> None:
    client = rlix.client.connect()
    info = client.info
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(info.model_path)
    model = AutoModelForCausalLM.from_pretrained(info.model_path, dtype=torch.float32)
    prompts = Dataset.from_list([{"prompt": f"Repeat: a {i}"} for i in range(64)])
    args = GRPOConfig(
        output_dir=os.environ.get("TRL_OUTPUT_DIR", "runs/trl_grpo/trl-output"), max_steps=info.steps,
        learning_rate=float(os.environ.get("TRL_LR", "3e-3")), per_device_train_batch_size=16,
        num_generations=4, max_completion_length=int(os.environ.get("TRL_MAX_COMPLETION", "12")), temperature=1.0, use_vllm=False, use_cpu=info.device != "cuda",
        bf16=False, logging_steps=1, save_strategy="no", report_to=[], seed=0, beta=0.0)
    adapter = RlixTRL(client)
    trainer = adapter.grpo_trainer(model=model, processing_class=tokenizer, reward_funcs=[says_a], args=args,
                                   train_dataset=prompts)
    trainer.train()
    adapter.close()


if __name__ == "__main__":
    main()
