"""Engine bookkeeping in pure Python (no torch, no Redis): ``scheduling`` (requests, the scheduler and the
StepPlan it hands to the runner, outputs), ``kv_cache`` (block pool and manager, tiers, KV events) and
``speculative`` (its configuration and costs). Scheduling reads the other two; they import neither it
nor each other."""
