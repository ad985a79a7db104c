"""Paged attention in torch's hands: the layer that stores K/V and attends through block tables, a
step's inputs in the order it wants them, and the calibrated key rotation of a quantized cache."""
