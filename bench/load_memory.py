"""A worker's memory: each configuration's engine loaded in a fresh process (``LLM(...)``, the default
KV budget), its peak resident set while loading (``VmHWM``) and its resident set once loaded, a
generation run, plus what the imports alone hold; the ratios against the first configuration.

    python -m pagedserve.bench.load_memory [--model M] [--configs float32 bfloat16 int8 int4 gguf]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from pagedserve.bench.table import print_table

CONFIGS = {  # name -> LLM options
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "gguf": {"quantization": "gguf"},  # a quantized GGUF's blocks as stored, the default dtype
}
CHILD = """
import json, sys
def mib():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(status[key].split()[0]) // 1024 for key in ("VmRSS", "VmHWM")}
from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
imported = mib()["VmRSS"]
llm = LLM(sys.argv[1] or None, **json.loads(sys.argv[2]))
loaded = mib()
llm.generate(["The history of"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
print(json.dumps({"imports_mib": imported, "load_peak_mib": loaded["VmHWM"], "loaded_mib": loaded["VmRSS"],
                  "after_generate_mib": mib()["VmRSS"]}))
"""


def measure(model: str | None, options: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model or "", json.dumps(options)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"loading with {options} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--configs", nargs="+", default=["float32", "bfloat16", "int8", "int4"], choices=CONFIGS)
    args = ap.parse_args(argv)
    rows = [{"config": name, **measure(args.model, CONFIGS[name])} for name in args.configs]
    for row in rows:
        row["peak_ratio"] = round(row["load_peak_mib"] / rows[0]["load_peak_mib"], 2)
        row["loaded_ratio"] = round(row["loaded_mib"] / rows[0]["loaded_mib"], 2)
    print(json.dumps({"bench": "load_memory", "model": args.model or "default", "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in ("config", "imports_mib", "load_peak_mib", "loaded_mib",
                                                          "after_generate_mib", "peak_ratio", "loaded_ratio")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
