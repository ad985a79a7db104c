"""``pagedserve/embedded_redis.py``: a redis-server of our own on a free port, even when the port
picked was taken by another process before the server bound it (parallel test processes pick
ports at once)."""

from __future__ import annotations

from pagedserve.embedded_redis import RedisServer, serving_pid


def test_a_port_taken_meanwhile_is_met_with_another_and_the_neighbour_is_not_mistaken_for_ours(tmp_path):
    neighbour = RedisServer(tmp_path / "a").start()
    ours = RedisServer(tmp_path / "b")
    ours.port = neighbour.port  # free when picked, taken before our server bound it
    try:
        ours.start()
        assert ours.port != neighbour.port and serving_pid(ours.port) == ours.proc.pid
        assert serving_pid(neighbour.port) == neighbour.proc.pid
    finally:
        ours.stop()
        neighbour.stop()
