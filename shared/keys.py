"""Every Redis name the system uses, in one place. Change the prefix to run two deployments on one Redis."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "pagedserve"

    def requests(self, model: str) -> str:
        """The request stream of one model (XADD by gateways and producers)."""
        return f"{self.prefix}:requests:{model}"

    def group(self, model: str) -> str:
        """The consumer group of the workers serving one model."""
        return f"{self.prefix}:workers:{model}"

    def dead_letter(self, model: str) -> str:
        """Entries that could not be served, with the reason."""
        return f"{self.prefix}:dead:{model}"

    def cancel(self, model: str) -> str:
        """Pub/sub channel for cancel messages (client gone, deadline) to the model's workers."""
        return f"{self.prefix}:cancel:{model}"

    def replies(self, gateway_id: str) -> str:
        """Pub/sub channel of one gateway instance: every event for its requests."""
        return f"{self.prefix}:replies:{gateway_id}"

    def results(self, client_id: str) -> str:
        """Durable result stream of one queue producer (``QueueClient(durable=True)``)."""
        return f"{self.prefix}:results:{client_id}"

    def allows_reply(self, kind: str, name: str) -> bool:
        """Workers publish only into reply channels and result streams: a request cannot aim its
        events at any other key (a worker's own liveness key, another model's stream)."""
        prefix = {"channel": f"{self.prefix}:replies:", "stream": f"{self.prefix}:results:"}.get(kind)
        return prefix is not None and name.startswith(prefix) and len(name) > len(prefix)

    def streamed(self, request_id: str) -> str:
        """Set once a request's first event went out: a reclaimed entry must not restart silently."""
        return f"{self.prefix}:streamed:{request_id}"

    def alive(self, model: str, consumer: str) -> str:
        """Worker heartbeat (expires when the worker stops beating)."""
        return f"{self.prefix}:alive:{model}:{consumer}"

    def alive_pattern(self, model: str = "*") -> str:
        return f"{self.prefix}:alive:{model}:*"

    def metrics(self, model: str, consumer: str) -> str:
        """Hash of a worker's latest metrics, read by the gateway's /metrics."""
        return f"{self.prefix}:metrics:{model}:{consumer}"
