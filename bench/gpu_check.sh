#!/usr/bin/env bash
# The GPU check for the device tool: GPU-marked kernel tests, then the decode kernel benchmark.
# Writes everything under $OUT (default ./out). Needs the project installed (pip install -e ".[dev]").
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -m pytest -m gpu tests/kernels/test_kernels_triton.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt"
python -m bench.kernel_bench --out "$out/kernel_bench.json" 2>&1 | tee "$out/kernel_bench.txt"
