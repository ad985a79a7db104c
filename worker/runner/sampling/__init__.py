"""From logits to tokens: batched sampling, structured-output masks and beam search."""
