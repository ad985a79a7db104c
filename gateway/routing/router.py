"""Prefix-aware routing: send a request to the worker whose prefix cache holds the most of its
prompt, unless that worker is busy; else to the model's shared stream, as without routing.

For each live worker ``w`` (one that beats and is not draining, with the load its ``WorkerInfo``
reports: ``gateway/routing/worker_directory.py``):

    score(w) = matched_tokens(w) / prompt_tokens  -  load_weight * (running(w) + waiting(w)) / max_num_seqs(w)

``matched_tokens`` comes from the KV index (the prompt's block-hash chain, computed here as the
worker computes it: ``shared/block_hash.py``, salted with the tenant); a block the worker holds
only below its device (host memory, disk) counts ``lower_tier_weight`` of one on the device, as a
hit there costs a copy up (measured 2.5-3.7x cheaper than recomputing, not free). The best-scoring worker
gets the request on its own stream when it holds at least ``min_match_blocks`` blocks of the
prompt, has fewer than ``busy_waiting`` requests waiting, and holds fewer than ``imbalance`` more
requests (running + waiting) than the least loaded live worker; otherwise the shared stream, so
nothing waits on one worker while another is idle (a hot prefix then gets cached by a second
worker too). Between load reports the router counts what it sent each worker as waiting there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.gateway.routing.kv_index import KvIndex
from pagedserve.gateway.routing.worker_directory import WorkerDirectory, Workers
from pagedserve.shared.block_hash import cache_salt, prefix_hashes
from pagedserve.shared.keys import Keys
from pagedserve.shared.worker_info import holds_adapter

FORGET_AFTER_S = 60.0  # a worker that has not beaten for this long leaves the index


@dataclass(frozen=True)
class RoutingPolicy:
    mode: str = "prefix"  # "prefix": as above; "shared": every request on the shared stream
    load_weight: float = 1.0
    min_match_blocks: int = 1
    busy_waiting: int = 8
    imbalance: int = 16
    lower_tier_weight: float = 0.5


@dataclass
class WorkerLoad:
    running: float
    waiting: float
    max_num_seqs: float
    block_size: int  # the worker's, as it hashes its blocks
    rope_switch: int
    sent: int = 0  # routed here since the last report
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds, NAME@DIGEST

    @property
    def held(self) -> float:
        """Requests running, waiting, and routed here since the last report."""
        return self.running + self.waiting + self.sent


@dataclass
class Router:
    workers: WorkerDirectory
    keys: Keys
    model: str
    policy: RoutingPolicy = RoutingPolicy()
    index: KvIndex = field(default_factory=KvIndex)
    loads: dict[str, WorkerLoad] = field(default_factory=dict)
    _read_at: float | None = None  # when the directory read the loads in use
    _last_seen: dict[str, float] = field(default_factory=dict)

    async def route(self, prompt_ids: list[int], tenant: str | None, adapter: str | None = None) -> str | None:
        """The stream for this prompt: the chosen worker's own, or None (the model's shared stream).
        ``adapter``: a LoRA adapter's NAME@DIGEST: only workers holding it, its blocks salted with it
        as the worker salts them (``Engine.add_encoded``)."""
        if self.policy.mode != "prefix" or len(prompt_ids) < 2:
            return None
        await self._refresh_loads()
        best, best_score = None, float("-inf")
        held = {w: load.held for w, load in self.loads.items()}
        least = min(held.values(), default=0.0)
        hashes_by_layout: dict[tuple[int, int], list[int]] = {}
        for worker, load in self.loads.items():
            if adapter is not None and adapter not in load.adapters:
                continue
            layout = (load.block_size, load.rope_switch)
            if layout not in hashes_by_layout:
                salt = cache_salt(tenant if adapter is None else (adapter, tenant), len(prompt_ids), load.rope_switch)
                hashes_by_layout[layout] = prefix_hashes(prompt_ids, load.block_size, salt)
            match = self.index.matched(worker, hashes_by_layout[layout])
            blocks = match.device + self.policy.lower_tier_weight * match.below
            if (match.blocks < self.policy.min_match_blocks or load.waiting + load.sent >= self.policy.busy_waiting
                    or held[worker] - least >= self.policy.imbalance):
                continue
            busy = held[worker] / max(1.0, load.max_num_seqs)
            score = blocks * load.block_size / len(prompt_ids) - self.policy.load_weight * busy
            if score > best_score:
                best, best_score = worker, score
        if best is None:
            return None
        self.loads[best].sent += 1
        return self.keys.routed(self.model, best)

    async def route_request(self, workers: Workers, prompt_ids: list[int], tenant: str | None,
                            adapter: str | None = None) -> str | None:
        """``route`` for a request, by its LoRA ``adapter``'s name where it has one: its blocks are
        salted with the adapter's NAME@DIGEST, so prefix routing only where the workers agree on it,
        and never the shared stream while some worker lacks the adapter (one whose load failed, one
        starting): the least loaded holder's stream then."""
        if adapter is None:
            return await self.route(prompt_ids, tenant)
        key = workers.adapter_key(adapter)
        stream = await self.route(prompt_ids, tenant, key) if key is not None else None
        if stream is None and not workers.everyone_holds(adapter):
            stream = await self.holder(adapter)
        return stream

    async def holder(self, adapter: str) -> str | None:
        """The own stream of the least loaded live worker holding LoRA adapter ``adapter`` (by name,
        any bytes), whatever the policy: where only some workers hold it, the shared stream could hand
        its request to one that does not. None when none holds it."""
        await self._refresh_loads()
        holders = [(load.held, worker) for worker, load in self.loads.items() if holds_adapter(load.adapters, adapter)]
        if not holders:
            return None
        worker = min(holders)[1]
        self.loads[worker].sent += 1
        return self.keys.routed(self.model, worker)

    async def _refresh_loads(self) -> None:
        """The live workers' loads, as new as the directory's read (between two reads, what was sent
        each worker counts as waiting there); the index forgets workers gone for a minute (one only
        starting may publish KV events before its first heartbeat)."""
        live = await self.workers.workers(self.model)
        if live.read_at == self._read_at:
            return
        self._read_at = now = live.read_at
        self.loads = {w.name: WorkerLoad(w.running, w.waiting, max(1, w.max_num_seqs), w.block_size, w.rope_switch,
                                         adapters=w.adapters)
                      for w in live.infos if not w.draining}
        self._last_seen.update(dict.fromkeys(self.loads, now))
        for gone in [w for w in self.index.blocks if now - self._last_seen.setdefault(w, now) > FORGET_AFTER_S]:
            self.index.forget(gone)
            del self._last_seen[gone]
