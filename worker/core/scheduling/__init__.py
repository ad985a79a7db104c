"""Scheduling: requests and their sequences, the scheduler and the StepPlan it hands to the runner,
applying a step's results, outputs and detokenization, the engine's numbers."""
