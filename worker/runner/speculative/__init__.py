"""Speculative decoding's device half: which draft tokens the model keeps, and the draft model that
proposes them."""
