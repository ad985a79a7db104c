"""Engine bookkeeping in pure Python (no torch, no Redis): requests, block pool and block manager,
the scheduler and the StepPlan it hands to the runner, configs, detokenization and outputs."""
