"""Where a model comes from: a local directory, a GGUF file (opened, read as a model directory, its
tensors dequantized), a hub id, the default model read out of its wheel, or the random-weight
demo models."""
