"""Models: the policy, the reference, LoRA / QLoRA and completion log-probs (modeling.py), the embedded default
(embedded.py), model folders for inference (folders.py), reward models (reward_models.py)."""
