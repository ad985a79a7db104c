"""The attention backends the kernel ops offer (``ops.select_ops``), in a module without torch so
the engine flags can name them."""

BACKENDS = ("auto", "torch", "native", "triton")
