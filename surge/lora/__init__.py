"""Multi-LoRA serving: PEFT adapters read onto the model's linear layers (peft.py), and a runner's slot pool
(manager.py)."""
