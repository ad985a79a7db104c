"""``pagedserve up`` as a user runs it: one command, a completion over HTTP, SIGTERM, nothing left behind."""

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pagedserve.embedded_redis import free_port


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def terminate_leaving_nothing(proc: subprocess.Popen, exit_code: int) -> None:
    """SIGTERM ``proc`` (running a stack: redis-server, a worker, a gateway at least): it exits
    with ``exit_code`` and none of its children is left running."""
    children = descendants(proc.pid)
    assert len(children) >= 3  # redis-server, a worker, a gateway
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == exit_code
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "orphans left running"


def complete(port: int) -> dict:
    body = json.dumps({"model": "demo", "prompt": "Hello", "max_tokens": 5}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_up_serves_revives_a_killed_worker_and_sigterm_leaves_nothing(tmp_path):
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "up", "demo", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "pagedserve up printed nothing within 300 s"
        banner = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in banner, banner
        assert complete(port)["usage"]["completion_tokens"] == 5
        workers = [p for p in descendants(proc.pid) if b"pagedserve.cli\x00worker" in cmdline(p)]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)  # the stack starts it again; meanwhile the gateway says 503
        deadline = time.monotonic() + 180
        while True:
            try:
                assert complete(port)["usage"]["completion_tokens"] == 5
                break
            except urllib.error.HTTPError as err:
                assert err.code == 503 and time.monotonic() < deadline, err
                time.sleep(0.5)
        terminate_leaving_nothing(proc, exit_code=0)
    finally:
        proc.kill()
        proc.wait()


def test_workers_share_the_cores_unless_told_otherwise():
    import os

    from pagedserve.stack import worker_environment

    cores = len(os.sched_getaffinity(0))
    assert worker_environment({"PATH": "/bin"}, 2) == {"PATH": "/bin", "OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert worker_environment({}, 10 * cores)["OMP_NUM_THREADS"] == "1"
    assert worker_environment({"OMP_NUM_THREADS": "7"}, 2)["OMP_NUM_THREADS"] == "7"


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_drains_the_request_in_flight_and_stops_redis_last(tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group. The request being streamed
    must finish (the gateway and worker drain), and the stack must be gone within seconds."""
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    log = open(tmp_path / "stderr.log", "w")  # a file, not a pipe: the children write to it too
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "demo", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and f":{port}" in proc.stdout.readline()
        redis = [p for p in descendants(proc.pid) if b"redis-server" in cmdline(p)]
        assert len(redis) == 1 and os.getpgid(redis[0]) != os.getpgid(proc.pid)  # out of the terminal's reach
        body = json.dumps({"model": "demo", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as stream:
            assert stream.readline().startswith(b"data: ")  # generating now
            os.killpg(proc.pid, signal.SIGINT)
            rest = stream.read()
        assert b'"finish_reason":"length"' in rest and rest.endswith(b"data: [DONE]\n\n"), rest[-300:]
        assert proc.wait(timeout=60) == 0  # drained and gone, not killed at a deadline
        assert not alive(redis[0])
        said = [line for line in (tmp_path / "stderr.log").read_text().splitlines() if line.startswith("pagedserve: ")]
        assert said[0].startswith(f"pagedserve: starting 'demo' on http://127.0.0.1:{port}")  # at once, before the model loads
        assert said[1].startswith("pagedserve: stopping") and said[-1] == "pagedserve: stopped", said  # never silent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_a_busy_port_is_one_line_before_anything_starts(tmp_path):
    """The port is checked first: one line naming it, exit 1, and no worker ever started (no
    model loaded, no log line of one)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "demo", "--port", str(port)],
                                capture_output=True, text=True, timeout=120, env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"pagedserve: cannot listen on 127.0.0.1:{port}: Address already in use"]


STACK_SCRIPT = """
import sys, time
from pagedserve.stack import LocalStack
with LocalStack(model="demo") as stack:
    print(stack.url, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_script_using_the_stack_leaves_no_orphans_when_terminated(tmp_path):
    """A benchmark under ``timeout`` (SIGTERM) stops the stack it started: no worker, gateway or
    Redis is left running without a parent."""
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-c", STACK_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and proc.stdout.readline().startswith("http://"), "the stack did not come up within 300 s"
        terminate_leaving_nothing(proc, exit_code=128 + signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()
