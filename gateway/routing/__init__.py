"""Which worker gets a request: the live workers' directory, the prefix index fed by KV events, and
the router that scores them."""
