"""Multi-LoRA: PEFT adapters on one base model, mixed in one batch (docs/engine.md, "LoRA adapters")."""
