"""An external pipeline's program that takes its training GPUs and never gives them back (it
sleeps in its training step): rlix must fail the pipeline after external.after_training_timeout_s."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

import rlix.client

client = rlix.client.connect()
client.start(AutoModelForCausalLM.from_pretrained(client.info.model_path, dtype=torch.float32))
client.before_training(0)
time.sleep(3600)
