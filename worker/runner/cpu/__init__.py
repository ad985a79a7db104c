"""The CPU's forms of the model: our C kernels' linear layers and decode stack, weight-only
quantized layers, fused projections."""
