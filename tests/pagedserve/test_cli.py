"""The ``pagedserve`` command as a user runs it."""

import os
import subprocess
import sys

import pytest


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_generate_builds_the_demo_model_once_and_streams_text(tmp_path):
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    first = run_cli("generate", "--model", "demo", "--max-tokens", "5", "hello", env=env)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "demo-llama-v2" / "config.json").exists()
    second = run_cli("generate", "--model", "demo", "--max-tokens", "5", "hello", env=env)
    assert second.returncode == 0 and second.stdout == first.stdout  # deterministic model, greedy


def test_bad_values_are_one_clear_line(tmp_path):
    bad = run_cli("generate", "--temperature", "-1", "x", env={"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr
    worker = run_cli("worker", "--heartbeat", "5", "--claim-idle-ms", "1000")
    assert worker.returncode != 0 and "--heartbeat must be shorter" in worker.stderr
    env_bad = run_cli("worker", env={"PAGEDSERVE_MAX_INFLIGHT": "lots"})
    assert env_bad.returncode != 0 and "PAGEDSERVE_MAX_INFLIGHT" in env_bad.stderr and "Traceback" not in env_bad.stderr


@pytest.mark.slow
def test_chat_answers_each_line_until_eof(tmp_path):
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "chat", "--model", "demo", "--max-tokens", "4",
                             "--temperature", "0"],
                            input="hello\nand again\n", capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two answered prompts, then EOF at the third


def test_start_up_failures_are_one_clear_line_and_a_non_zero_exit(tmp_path):
    import socket

    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    missing = run_cli("worker", "--model", str(tmp_path / "no-such-model"), env=env)
    assert missing.returncode == 2 and "no model directory at" in missing.stderr, missing.stderr
    hub = run_cli("generate", "--model", "someone/some-model", "hi", env=env)
    assert hub.returncode == 2 and "pass a local model directory" in hub.stderr, hub.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("gateway", "--model", "demo", "--port", str(port), env=env)
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
    for result in (missing, hub, busy):  # the error is the last line, after at most a few log lines
        assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("pagedserve")


def test_bench_runs_from_the_installed_package_outside_a_checkout(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "kv-memory", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--block-size" in result.stdout, result.stderr


def test_every_flag_of_every_service_says_what_it_does_and_its_default_once():
    """``--help`` of serve, worker and gateway: each flag has its own words besides the default and
    the environment variable, and shows one default (not the words' and argparse's both)."""
    import argparse
    import re

    from pagedserve.cli import build_parser
    from pagedserve.gateway.service.settings import gateway_parser
    from pagedserve.worker.serve.settings import worker_parser

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    for parser in (serve, worker_parser({}), gateway_parser({})):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or not action.option_strings:
                continue
            text = parser._get_formatter()._expand_help(action) if action.help else ""
            words = re.sub(r"\((default: [^;)]*; )?env [A-Z_]+(, comma-separated)?\)$", "", text).strip()
            assert words, f"{parser.prog} {action.option_strings[0]} has no help of its own: {text!r}"
            assert text.count("default:") <= 1, f"{parser.prog} {action.option_strings[0]}: {text!r}"
            assert "(default: None" not in text, f"{parser.prog} {action.option_strings[0]} shows None: {text!r}"


def test_serve_takes_the_redis_url_and_stats_interval_the_readme_names():
    help_text = run_cli("serve", "--help").stdout
    assert "--redis-url" in help_text and "--log-stats-interval" in help_text
