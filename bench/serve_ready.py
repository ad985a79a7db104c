"""How long a server takes from its command to answering: ``pagedserve serve MODEL`` against
llama.cpp's ``llama-server -m FILE.gguf`` on the same file, one after the other, warm (the file in the
page cache: a first start is made and not counted).

For each start: seconds to the first line on the screen (stdout or stderr) and to ready (pagedserve:
``GET /ready`` 200; llama.cpp: ``GET /health`` 200), each server stopped (SIGTERM, then SIGKILL after
30 s) before the next starts. Prints one JSON line per server and a table.

    python -m pagedserve.bench.serve_ready --model qwen2.5-coder-1.5b-instruct-q4_k_m \\
        [--llama-server $PEERS/llamacpp_build/bin/llama-server --gguf FILE] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from pagedserve.bench.table import print_table
from pagedserve.embedded_redis import free_port

READY_TIMEOUT_S = 300.0


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


def time_start(command: list[str], ready_url: str) -> tuple[float, float]:
    """Seconds from starting ``command`` to its first output line and to ``ready_url`` answering 200."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    first_line = None
    watch = selectors.DefaultSelector()
    watch.register(process.stdout, selectors.EVENT_READ)
    try:
        while time.perf_counter() - start < READY_TIMEOUT_S:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode} before it was ready")
            for _key, _ in watch.select(timeout=0.05):
                if os.read(process.stdout.fileno(), 65536) and first_line is None:
                    first_line = time.perf_counter() - start
            if answers(ready_url):
                ready = time.perf_counter() - start
                return (ready if first_line is None else first_line), ready
        raise RuntimeError(f"{command[0]} not ready after {READY_TIMEOUT_S:.0f} s")
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    process.stdout.close()


def measure(name: str, make_command, ready_path: str, repeats: int) -> dict:
    """A first start not counted (the page cache, the kernels' build cache), then ``repeats`` timed."""
    runs = []
    for i in range(repeats + 1):
        port = free_port()
        first, ready = time_start(make_command(port), f"http://127.0.0.1:{port}{ready_path}")
        if i:
            runs.append((first, ready))
    return {"server": name, "first_line_s": round(statistics.median(r[0] for r in runs), 2),
            "ready_s": round(statistics.median(r[1] for r in runs), 2),
            "ready_runs_s": [round(r[1], 2) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="what `pagedserve serve` takes: a .gguf, a folder, a packaged name")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary, to time on --gguf")
    ap.add_argument("--gguf", help="the GGUF file llama-server serves (the same model)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = [measure("pagedserve", lambda port: [sys.executable, "-m", "pagedserve", "serve", args.model,
                                                   "--port", str(port)], "/ready", args.repeats)]
    if args.llama_server:
        if not args.gguf:
            ap.error("--llama-server needs --gguf")
        results.append(measure("llama.cpp", lambda port: [args.llama_server, "-m", args.gguf, "--port", str(port),
                                                          "--threads", str(os.cpu_count())], "/health", args.repeats))
    for result in results:
        print(json.dumps(result))
    base = results[-1]["ready_s"]
    print_table(results, [("server", lambda r: r["server"]), ("first line (s)", lambda r: f"{r['first_line_s']:.2f}"),
                          ("ready (s)", lambda r: f"{r['ready_s']:.2f}"),
                          ("ready / last", lambda r: f"{r['ready_s'] / base:.2f}x")])


if __name__ == "__main__":
    main()
