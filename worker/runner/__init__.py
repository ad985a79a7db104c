"""Torch execution of a StepPlan: the model runner and the loader on top; under them speculative
decoding's checks, the CPU's forms, the device, tensor parallel and LoRA; then sampling, the KV cache's
bytes, the models and, at the bottom, paged attention (docs/architecture.md)."""
