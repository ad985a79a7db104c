"""``pagedserve/embedded_redis.py``: a redis-server of our own on a free port, even when the port
picked was taken by another process before the server bound it (parallel test processes pick
ports at once)."""

from __future__ import annotations

import pytest

from pagedserve.embedded_redis import RedisClusterServers, RedisServer, free_port, serving_pid


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


def test_the_port_asked_again_comes_from_the_servers_own_picker(tmp_path):
    """A cluster node must listen below 55,536 (its bus port is 10,000 higher): when its first port
    was taken meanwhile, the next comes from its picker, not from any free port (redis-server
    refuses to start on 60,000 in cluster mode)."""
    neighbour = RedisServer(tmp_path / "a").start()
    picked = [neighbour.port]
    ours = RedisServer(tmp_path / "b", pick_port=lambda: picked[-1])
    picked.append(free_port())
    try:
        ours.start()
        assert ours.port == picked[-1] != neighbour.port and serving_pid(ours.port) == ours.proc.pid
    finally:
        ours.stop()
        neighbour.stop()


def test_a_cluster_whose_node_cannot_start_stops_the_nodes_it_had_started(tmp_path):
    """Nothing is left behind: a test whose cluster failed to start would otherwise leak servers."""
    cluster = RedisClusterServers(tmp_path, masters=2)
    cluster.nodes[1].extra_args += ("--no-such-directive", "yes")
    with pytest.raises(RuntimeError, match="exited"):
        cluster.start()
    first = cluster.nodes[0]
    assert first.proc is None and serving_pid(first.port) is None
