"""The load generators people already use, unchanged, against a running gateway: guidellm and
aiperf, chat and completions, streaming. Each tool lives in its own virtual environment (their
pins clash with ours), created under ``--tools-dir`` on first use with ``--install``.

    pagedserve serve --port 8124 &
    python -m bench.client_tools --url http://127.0.0.1:8124 --model demo \\
        --tokenizer ~/.cache/pagedserve/demo-llama-v2 --install

Prints one JSON line and a table (requests sent, succeeded, errored, output tok/s as the tool
measured it) and exits 1 when any request of any tool failed: the bar is zero errors.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

from pagedserve.bench.table import print_table

TOOLS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def tool_bin(tools_dir: Path, tool: str, install: bool) -> Path:
    env = tools_dir / tool
    exe = env / "bin" / tool
    if not exe.exists():
        if not install:
            sys.exit(f"{exe} is missing: run with --install (pip install {TOOLS[tool]} into {env})")
        venv.create(env, with_pip=True)
        subprocess.run([str(env / "bin" / "pip"), "install", "-q", TOOLS[tool]], check=True)
    return exe


def run_guidellm(exe: Path, args, endpoint: str, out: Path) -> dict:
    report = out / f"guidellm-{endpoint}.json"
    subprocess.run([
        str(exe), "run", "--backend",
        f"kind=openai_http,target={args.url},model={args.model},request_format={ENDPOINTS[endpoint]}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--output", f"kind=json,path={report}", "--disable-progress",
    ], check=True, capture_output=True, timeout=args.timeout)
    bench = json.loads(report.read_text())["benchmarks"][0]
    state = bench["scheduler_state"]
    tokens = bench["metrics"].get("output_tokens_per_second", {}).get("successful", {}).get("mean")
    return {"sent": state["created_requests"], "ok": state["successful_requests"],
            "errors": state["errored_requests"] + state["cancelled_requests"], "output_tok_s": tokens}


def run_aiperf(exe: Path, args, endpoint: str, out: Path) -> dict:
    artifacts = out / f"aiperf-{endpoint}"
    subprocess.run([
        str(exe), "profile", "-m", args.model, "-u", args.url, "--endpoint-type", endpoint, "--streaming",
        "--request-count", str(args.requests), "--concurrency", str(args.concurrency), "--tokenizer", str(args.tokenizer),
        "--prompt-input-tokens-mean", str(args.prompt_tokens), "--prompt-output-tokens-mean", str(args.output_tokens),
        "--ui-type", "none", "--output-artifact-dir", str(artifacts), "--no-server-metrics", "--no-gpu-telemetry",
    ], check=True, capture_output=True, timeout=args.timeout)
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    count = int(summary["request_count"]["avg"])
    errors = sum(int(e.get("count", 1)) for e in summary.get("error_summary") or [])
    return {"sent": count + errors, "ok": count, "errors": errors, "output_tok_s": summary["output_token_throughput"]["avg"]}


RUNNERS = {"guidellm": run_guidellm, "aiperf": run_aiperf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8124")
    p.add_argument("--model", default="demo", help="the served model name")
    p.add_argument("--tokenizer", type=Path, required=True, help="the model directory (its tokenizer)")
    p.add_argument("--tools-dir", type=Path, default=Path.home() / ".cache" / "pagedserve" / "client-tools")
    p.add_argument("--install", action="store_true", help="create the tools' environments when missing")
    p.add_argument("--tools", default="guidellm,aiperf")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("client-tools-out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tool in args.tools.split(","):
        exe = tool_bin(args.tools_dir, tool, args.install)
        for endpoint in ENDPOINTS:
            try:
                rows.append({"tool": tool, "endpoint": endpoint, **RUNNERS[tool](exe, args, endpoint, args.out.resolve())})
            except subprocess.CalledProcessError as err:
                tail = (err.stderr or b"")[-600:].decode(errors="replace")
                rows.append({"tool": tool, "endpoint": endpoint, "sent": 0, "ok": 0, "errors": -1, "output_tok_s": None,
                             "failure": f"exit {err.returncode}: {tail}"})
    print(json.dumps({"bench": "client_tools", "url": args.url, "requests": args.requests, "results": rows}))
    print_table(rows, [("tool", lambda r: r["tool"]), ("endpoint", lambda r: r["endpoint"]), ("sent", lambda r: r["sent"]),
                       ("ok", lambda r: r["ok"]), ("errors", lambda r: r["errors"]),
                       ("output tok/s", lambda r: "-" if r["output_tok_s"] is None else f"{r['output_tok_s']:.1f}")])
    return 0 if all(r["errors"] == 0 and r["ok"] == args.requests for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
