"""The ``pagedserve`` command as a user runs it."""

import os
import subprocess
import sys


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_builds_the_demo_model_once_and_streams_text(tmp_path):
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    first = run_cli("generate", "--max-tokens", "5", "hello", env=env)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "demo-llama-v1" / "config.json").exists()
    second = run_cli("generate", "--max-tokens", "5", "hello", env=env)
    assert second.returncode == 0 and second.stdout == first.stdout  # deterministic model, greedy


def test_bad_values_are_one_clear_line(tmp_path):
    bad = run_cli("generate", "--temperature", "-1", "x", env={"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr
    worker = run_cli("worker", "--heartbeat", "5", "--claim-idle-ms", "1000")
    assert worker.returncode != 0 and "--heartbeat must be shorter" in worker.stderr
    env_bad = run_cli("worker", env={"PAGEDSERVE_MAX_INFLIGHT": "lots"})
    assert env_bad.returncode != 0 and "PAGEDSERVE_MAX_INFLIGHT" in env_bad.stderr and "Traceback" not in env_bad.stderr


def test_chat_answers_each_line_until_eof(tmp_path):
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "chat", "--max-tokens", "4", "--temperature", "0"],
                            input="hello\nand again\n", capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two answered prompts, then EOF at the third
