"""Training side of async GRPO: GRPO maths (grpo.py), the PolicyTrainer (trainer.py), its Ray
ranks (ranks.py: TrainerActor, TrainerGroup) and the value types the pipeline shares with them (types.py).

Importing the package imports nothing heavy, so `rlix.training.types` stays torch-free.
"""
