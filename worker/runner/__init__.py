"""Torch execution of a StepPlan: the model runner, paged attention, sampling, beam search, the
weight loader and the model definitions."""
