#!/usr/bin/env bash
# The GPU check for the device tool (at most 9 minutes: each step has its own time limit): every
# GPU-marked test (the quantized-cache kernels' among them), the decode kernel benchmark, decode
# attention over int8 and fp8 caches against bfloat16 (Hopper), and offline throughput of a ~1.1B-parameter
# random-weight Llama in bfloat16 (built on the GPU from a config; nothing downloaded), with CUDA
# graphs and eagerly, against transformers on the same GPU.
# Writes logs and JSON under $OUT (default ./out). Needs the project installed (`make test` set-up,
# or pip install -e ".[dev]" with a CUDA torch).
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
py="${PYTHON:-python}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name(0))' > "$out/versions.txt" 2>&1
status=0
timeout 240 "$py" -m pytest -m gpu tests -p no:cacheprovider -rA --junitxml="$out/gpu_tests.xml" > "$out/gpu_tests.txt" 2>&1 || status=1
tail -n 40 "$out/gpu_tests.txt"
timeout 45 "$py" -m pagedserve.bench.kernel_bench --out "$out/kernel_bench.json" > "$out/kernel_bench.txt" 2>&1 || status=1
tail -n 15 "$out/kernel_bench.txt"
timeout 30 "$py" -m pagedserve.bench.kv_decode --backend triton --device cuda --dtype bfloat16 > "$out/kv_decode.txt" 2>&1 || status=1
tail -n 4 "$out/kv_decode.txt"
for mode in graphs eager; do  # decode steps replayed from CUDA graphs, then launched eagerly
    timeout 100 "$py" -m pagedserve.bench.offline_throughput --preset llama-1b --dtype bfloat16 --requests 128 --hf-batch 64 \
        --max-num-batched-tokens 4096 --model-dir "${TMPDIR:-/tmp}/pagedserve-llama-1b" \
        $([ "$mode" = eager ] && echo --enforce-eager) --out "$out/offline_throughput_$mode.json" \
        > "$out/offline_throughput_$mode.txt" 2>&1 || status=1
    tail -n 6 "$out/offline_throughput_$mode.txt"
done
exit "$status"
