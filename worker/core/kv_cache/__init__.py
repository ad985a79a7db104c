"""The KV cache's bookkeeping: the block pool with its prefix cache, block tables over a device and
a CPU pool, the host and disk tiers under the prefix cache, and the KV events a worker publishes."""
