"""Every Redis name the system uses, in one place. Change the prefix to run two deployments on one Redis.

Every key of one model carries the model as a hash tag (``pagedserve:{model}:…``), so on a Redis
Cluster its streams, their group, dead letters, KV events, liveness and metrics keys live in one
slot: the multi-key commands (a worker's read of its own and the model's stream, the Lua scripts,
the hand-back transaction) stay legal, and models spread over the cluster's slots. Pub/sub
channels belong to no slot. Keys of one request or client (``streamed``, ``results``) stand alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "pagedserve"

    def model_space(self, model: str) -> str:
        """Where one model's keys live: ``{prefix}:{{model}}`` (a Redis Cluster hash tag)."""
        return f"{self.prefix}:{{{model}}}"

    def requests(self, model: str) -> str:
        """The request stream of one model (XADD by gateways and producers)."""
        return f"{self.model_space(model)}:requests"

    def routed(self, model: str, consumer: str) -> str:
        """One worker's own request stream: requests the gateway routed to it (its prefix cache
        holds their prefix). The worker reads it before the model's stream; when the worker dies,
        another moves what is left onto the model's stream."""
        return f"{self.model_space(model)}:routed:{consumer}"

    def routed_pattern(self, model: str) -> str:
        return f"{self.model_space(model)}:routed:*"

    def kv_events(self, model: str) -> str:
        """Stream of the model's workers' KV events: prefix-cache blocks published and dropped."""
        return f"{self.model_space(model)}:kv"

    def dashboard(self, model: str) -> str:
        """Pub/sub channel of the model's workers' KV dashboard snapshots (``worker/core/scheduling/kv_snapshot.py``)."""
        return f"{self.prefix}:dashboard:{model}"

    def dashboard_wake(self, model: str) -> str:
        """Pub/sub channel on which a gateway whose first dashboard opens asks the model's workers
        for a snapshot at once, instead of at their next look at the ``watched`` key."""
        return f"{self.prefix}:dashboard-wake:{model}"

    def dashboard_watched(self, model: str) -> str:
        """Set (with a short expiry, renewed) by a gateway while a dashboard is open: workers
        publish snapshots only then."""
        return f"{self.model_space(model)}:dashboard:watched"

    def stored_response(self, response_id: str) -> str:
        """A stored Responses API answer and the conversation behind it (a JSON string with an
        expiry): any gateway answers ``GET /v1/responses/{id}`` and continues it."""
        return f"{self.prefix}:response:{response_id}"

    def group(self, model: str) -> str:
        """The consumer group of the workers serving one model."""
        return f"{self.prefix}:workers:{model}"

    def dead_letter(self, model: str) -> str:
        """Entries that could not be served, with the reason."""
        return f"{self.model_space(model)}:dead"

    def adapters(self, model: str) -> str:
        """The model's LoRA adapters, name -> path (a hash): every worker of the model holds these
        (``POST /v1/load_lora_adapter`` writes it, workers follow it at each heartbeat)."""
        return f"{self.model_space(model)}:adapters"

    def adapter_errors(self, model: str) -> str:
        """Why a worker could not load an adapter of the registry, name -> message (a hash)."""
        return f"{self.model_space(model)}:adapter_errors"

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
        return f"{self.model_space(model)}:alive:{consumer}"

    def alive_pattern(self, model: str = "*") -> str:
        return f"{self.model_space(model)}:alive:*"

    def model_of(self, key: str) -> str:
        """The model a per-model key belongs to (the hash tag)."""
        return key[len(self.prefix) + 2 : key.index("}:", len(self.prefix) + 2)]

    def worker_info(self, model: str, consumer: str) -> str:
        """A worker's ``WorkerInfo`` (``shared/worker_info.py``), renewed with its heartbeat and
        expiring with it: what the gateways route, admit and limit contexts by."""
        return f"{self.model_space(model)}:info:{consumer}"

    def worker_info_pattern(self, model: str = "*") -> str:
        return self.worker_info(model, "*")

    def metrics(self, model: str, consumer: str) -> str:
        """Hash of a worker's latest metrics, read by the gateway's /metrics."""
        return f"{self.model_space(model)}:metrics:{consumer}"


DEMO_NAME = "demo"  # the random-weight demo model (``--model demo``), for tests and benchmarks
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # served when no model is named (worker/source/packaged_models.py)


def served_name(model: str | None, served_model_name: str | None) -> str:
    """The name clients use, which names the model's streams: the explicit one, else the model
    as given, else the default model's name."""
    return served_model_name or model or DEFAULT_MODEL_NAME
