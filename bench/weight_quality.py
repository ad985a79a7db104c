"""What quantized weights cost in quality, on real weights: the default model (SmolLM2-135M-
Instruct) reads ``bench/texts/declaration.txt`` teacher-forced (as ``bench/kv_quality.py`` does),
once per ``--quantization``; against the model-dtype weights: next-token top-1 agreement and
perplexity. The cache stays at the model's dtype, so only the weights differ.

    python -m pagedserve.bench.weight_quality [--model M] [--quantizations none int8 int4]
"""

from __future__ import annotations

import argparse
import sys

from pagedserve.bench.kv_quality import quality_table
from pagedserve.kernels.backends import QUANTIZATIONS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"], choices=QUANTIZATIONS)
    args = ap.parse_args(argv)
    quality_table("weight_quality", "quantization", args.quantizations, "none", args.model, args.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
