"""The attention backends the kernel ops offer (``ops.select_ops``), in a module without torch so
the engine flags can name them."""

BACKENDS = ("auto", "torch", "native", "triton")
# how K/V may be stored (paged_kernels/kv_format.py): vLLM's names, plus int8 for CPUs
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
PRODUCT_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3")  # the caches --quantized-products multiplies as stored
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")  # --quantization: the linear layers' weights (worker/runner/cpu/quantized_linear.py)
