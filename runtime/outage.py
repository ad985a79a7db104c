"""How long Redis has been unreachable, as the calls that failed and the ones that got through
tell, and what to do past ``grace_s`` (``--outage-grace``): a Redis restarted or failed over comes
back within it, and everything held waits for it as before; one that does not is an outage, and
what waited on it ends with an error (gateway, ``runtime/replies.py``) or is let go (worker,
``worker/serve/service.py``) instead of waiting for its deadline.

The grace should be longer than a failover or a restart takes, and is independent of the worker's
``--heartbeat``: a worker silent for three heartbeats is taken for dead by the other workers, but
while Redis is away nobody can take anything over, and its entries are still its own when Redis
comes back within the grace (docs/protocol.md, "Failure handling").
"""

from __future__ import annotations

import time

DEFAULT_GRACE_S = 30.0


class RedisGone(ConnectionError):
    """Redis was unreachable for longer than the outage grace: what waited on it cannot be answered."""

    def __init__(self, down_s: float) -> None:
        super().__init__(f"Redis, the queue between the gateway and the workers, has been unreachable for "
                         f"{down_s:.0f} s; the request cannot be finished: retry once the service is back")


class Outage:
    """When Redis stopped answering (None while it answers), from ``failed`` and ``reached`` calls."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, clock=time.monotonic) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.since: float | None = None

    def failed(self) -> None:
        """A call to Redis failed for want of a connection."""
        if self.since is None:
            self.since = self.clock()

    def reached(self) -> None:
        """A call to Redis got through."""
        self.since = None

    @property
    def down(self) -> bool:
        """Whether the last call found Redis unreachable."""
        return self.since is not None

    @property
    def down_s(self) -> float:
        """Seconds since Redis stopped answering (0 while it answers)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def past_grace(self) -> bool:
        return self.down and self.down_s >= self.grace_s

    def gone(self) -> RedisGone:
        return RedisGone(self.down_s)
