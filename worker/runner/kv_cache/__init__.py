"""The KV cache's bytes: the device pool's layout and the host tier's storage with the copies
between them."""
