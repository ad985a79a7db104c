"""What a Responses API continuation gains from the prefix cache: the time to the first token of a
``previous_response_id`` turn (its prompt begins with the stored conversation, so routing sends it to
the worker that served the last turn, whose prefix cache holds it) against a fresh request of about
the same length (text nothing cached begins with), on a local stack with the real default model.
The two alternate, each repeat on text of its own (the same paragraphs, rotated: no shared start).

    python -m pagedserve.bench.responses_continuation [--repeats 5] [--words 600]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

import httpx

from pagedserve.bench.table import print_table
from pagedserve.stack import LocalStack

FOLLOW_UP = "Now say it in one word."


def passage(words: list[str], start: int, count: int) -> str:
    return " ".join(words[(start + i) % len(words)] for i in range(count))


def first_token_s(url: str, model: str, body: dict) -> tuple[float, int]:
    """Seconds to the first streamed text delta, and the prompt's tokens (from the last event)."""
    started, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/responses", json={"model": model, "stream": True, **body}, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                tokens = event["response"]["usage"]["input_tokens"]
    if first is None:
        raise RuntimeError("no text came back")
    return first, tokens


def measure(url: str, model: str, repeats: int, words: list[str], count: int) -> dict:
    continued, fresh, sizes = [], [], []
    greedy = {"temperature": 0.0, "max_output_tokens": 8}
    for i in range(repeats):
        ask = passage(words, 1 + 97 * i, count) + "\n\nWhat is this text about?"
        first = httpx.post(url + "/v1/responses", json={"model": model, "input": ask, "max_output_tokens": 16,
                                                        "temperature": 0.0}, timeout=300).json()
        seconds, tokens = first_token_s(url, model, {"previous_response_id": first["id"], "input": FOLLOW_UP, **greedy})
        continued.append(seconds)
        other = passage(words, 53 + 97 * i, count + 16) + "\n\nWhat is this text about?\n\n" + FOLLOW_UP
        seconds, fresh_tokens = first_token_s(url, model, {"input": other, **greedy})
        fresh.append(seconds)
        sizes.append((tokens, fresh_tokens))
    return {"continued_ms": 1000 * statistics.median(continued), "fresh_ms": 1000 * statistics.median(fresh),
            "speedup": statistics.median(f / c for f, c in zip(fresh, continued)),
            "prompt_tokens": [list(s) for s in sizes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--words", type=int, default=600, help="words of the first turn's text")
    parser.add_argument("--model", default=None, help="a model directory or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args()
    words = resources.files("pagedserve.bench").joinpath("texts/declaration.txt").read_text().split()
    with LocalStack(model=args.model, workers=1) as stack:
        result = measure(stack.url, stack.served_model_name, args.repeats, words, args.words)
    print(json.dumps({"bench": "responses_continuation", "repeats": args.repeats, "words": args.words, **result}))
    print_table([result], [("continuation TTFT ms", lambda r: round(r["continued_ms"], 1)),
                           ("fresh TTFT ms", lambda r: round(r["fresh_ms"], 1)),
                           ("fresh / continuation", lambda r: round(r["speedup"], 2)),
                           ("prompt tokens (continued, fresh)", lambda r: r["prompt_tokens"][0])])


if __name__ == "__main__":
    main()
