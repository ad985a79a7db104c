"""One gateway instance: its settings, what it holds (Redis, tokenizer, metrics, the OpenAPI spec)
and one generation request's life."""
