"""The KV dashboard's gateway side: the Redis feed fanned out to every open page, and the last
minute of latencies."""
