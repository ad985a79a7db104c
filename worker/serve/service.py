"""The worker service: Redis stream in, engine loop, pub/sub out. Nothing lost.

The engine runs in one thread (``EngineLoop``), the Redis I/O in another, on an asyncio loop; a
step never waits on Redis and Redis I/O never waits on a step. The CLI computes on the main
thread (``worker/serve/process.py``); ``run()`` (tests, embedding) is a coroutine that computes
on a worker thread. The I/O tasks, each supervised (``runtime/supervision.py``: logged, restarted
with backoff, the worker exits 1 when one keeps failing):

- reader: claims its own pending entries at start, then reads new entries while it has room and
  fewer than ``read_ahead`` requests wait to start (what it cannot start soon stays in the stream
  for other workers); every entry goes through ``intake.admit``: a request to run, or a dead
  letter with the reason; a re-sent request (``resume``) goes on from the tokens its client has;
- outputs: each step's outputs become one batch of events (on the I/O loop);
- publisher: sends each batch (one PUBLISH per reply channel per step, in order), then XACK+XDEL
  the finished entries; on connection loss it retries the same batch with backoff; nothing for
  entries it no longer holds (``worker/serve/outbox.py``);
- maintenance: heartbeats the in-flight entries it still holds (one that Redis lost or another
  worker took is stopped without a word: its client sends it again) and the liveness key,
  publishes metrics, and reclaims entries of dead workers (re-run from the prompt; if tokens were
  already sent, an error marked ``resumable`` so the client re-sends it with ``resume``; the
  dead-letter stream after ``max_deliveries``);
- cancels: aborts requests named on the model's cancel channel;
- kv events: what the prefix cache published and dropped, for the gateways' routing
  (``worker/serve/kv_publisher.py``);
- dashboard: the KV dashboard's snapshots while one is open, and at once when a gateway's first
  dashboard opens (dashboard wake: its channel) (``worker/serve/dashboard_publisher.py``).

Besides the model's stream the reader reads the worker's own (requests routed to it, first);
maintenance moves the own streams of dead workers onto the model's stream.

SIGTERM: stop reading, finish in-flight work (aborting what is left after ``drain_timeout``),
flush events, exit 0; within ``drain_timeout`` (and a few seconds to stop the I/O tasks) whatever
Redis does: while it is unreachable nothing held is waited for (its entries stay pending, for
another worker to take over), and events it cannot take by then are given up. Exit 4 when
requests were cut short that way, 1 after a task kept failing.

Redis unreachable for longer than the outage grace: the requests held are let go of
(``worker/serve/outage_watch.py``), and the worker reads new work once Redis is back.

Engine numbers for metrics come from the engine thread's snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
from redis.exceptions import ResponseError

from pagedserve.runtime.redis_client import connect
from pagedserve.runtime.redis_io import REDIS_DOWN, listen_forever, stop_tasks
from pagedserve.runtime.supervision import EXIT_CUT, supervise
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.keys import Keys
from pagedserve.shared.prompts import encode_chat
from pagedserve.shared.protocol import WireCancel, WireRequest
from pagedserve.worker.engine import Engine
from pagedserve.worker.serve.adapter_sync import AdapterSync
from pagedserve.worker.serve.bridge import ConsumerNameTaken, Entry, Outgoing, RedisBridge
from pagedserve.worker.serve.dashboard_publisher import DashboardPublisher
from pagedserve.worker.core.scheduling.token_pieces import TokenPieces
from pagedserve.worker.serve.events import InFlight, error_event, lost_event
from pagedserve.worker.serve.inflight import InFlightTable
from pagedserve.worker.serve.intake import Rejected, admit, salvage_reply
from pagedserve.worker.serve.kv_publisher import KvPublisher
from pagedserve.worker.serve.loop import EngineLoop
from pagedserve.worker.serve.metrics import WorkerMetrics
from pagedserve.worker.serve.outage_watch import OutageWatch
from pagedserve.worker.serve.outbox import Outbox
from pagedserve.worker.serve.self_report import SelfReport
from pagedserve.worker.serve.settings import WorkerSettings
from pagedserve.worker.serve.stats_log import StatsLine

log = structlog.get_logger("pagedserve.worker")
GOODBYE_S = 2.0  # the longest the last words to Redis (KV reset, leaving the group) are waited for


class WorkerService:
    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.model = settings.served_model_name
        self.keys = Keys(settings.key_prefix)
        self.inflight = InFlightTable(settings.max_inflight, settings.read_ahead, TokenPieces(engine.tokenizer))
        self.redis = connect(settings.redis_url)
        self.bridge = RedisBridge(self.redis, self.keys, self.model, settings.consumer)
        self.kv = KvPublisher(self.bridge, settings.consumer, settings.kv_events_interval_s, settings.kv_resync_s,
                              lambda: self.engine_loop.resync_kv(), lambda: self._retrying("kv events", self.redis.ping))
        self.dashboard = DashboardPublisher(self.redis, self.keys, self.model, settings.consumer, settings.dashboard_interval_s,
                                            lambda: self.engine_loop.want_picture(), lambda: self.report.dashboard_figures())
        self.engine_loop = EngineLoop(engine, self._outputs_from_engine_thread, on_kv=self.kv.from_engine_thread,
                                      on_picture=self.dashboard.from_engine_thread)
        self.outbox = Outbox(self.bridge, self.inflight, self.engine_loop.abort, settings.liveness_s)
        self.stopping = asyncio.Event()
        self.adapters = AdapterSync(self.redis, self.keys, self.model, engine, self.engine_loop, self.stopping)
        self.report = SelfReport(settings.consumer, self.model, engine.limits(), self.inflight, self.engine_loop, self.stopping,
                                 lambda: self.adapters.held)
        self._io_stop = asyncio.Event()  # the side tasks' Redis reads return once it is set
        self.outage = OutageWatch(settings.outage_grace_s, self.inflight, self.outbox, self.bridge, self.stopping,
                                  settings.liveness_s)
        self._stop_by: float | None = None  # SIGTERM: when the drain's time is up (monotonic)
        self.cut = False  # requests were cut short: aborted at the drain timeout, or their events never went out
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._text_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.prometheus = (WorkerMetrics(settings.metrics_port, self.model, settings.metrics_host, engine.limits())
                           if settings.metrics_port else None)
        self.stats_line = StatsLine(settings.log_stats_interval_s)

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        """SIGTERM: stop reading, finish what is held, abort what is left after the drain timeout."""
        if not self.stopping.is_set():
            log.info("draining", in_flight=len(self.inflight), redis_reachable=not self.outage.down)
            self.stopping.set()
            self.inflight.room.set()
            self._stop_by = time.monotonic() + self.settings.drain_timeout_s
            asyncio.get_running_loop().call_later(self.settings.drain_timeout_s, self._abort_leftovers)
            if self.outage.down:  # nothing generated now could go out: wait for nothing
                self.outage.let_go_held("stopping while Redis is unreachable")
            self._finish_if_drained()

    async def run(self) -> int:
        """Serve until stopped, computing on a worker thread."""
        loop = asyncio.get_running_loop()
        return await self.serve_io(lambda: loop.run_in_executor(self._engine_thread, self.engine_loop.run))

    async def serve_io(self, engine_finished) -> int:
        """The Redis side until the engine loop returns (``engine_finished`` awaits that)."""
        self._loop = self.kv.loop = self.dashboard.loop = asyncio.get_running_loop()
        try:
            await self._retrying("create group", self.bridge.ensure_group)
            await self._retrying("publish adapters", lambda: self.adapters.publish_startup(self.engine.config.lora_adapters))
            # Names are stable (a restarted worker takes its pending entries back): two live workers
            # must not share one; a crashed predecessor's key expires within three heartbeats.
            ttl = self.settings.liveness_s
            await self._retrying("claim consumer name",
                                 lambda: self.bridge.wait_for_name(ttl, ttl + 1, self.report.worker_info({}).encode()))
        except ConsumerNameTaken:
            self.engine_loop.finish()
            await self.redis.aclose()
            raise
        log.info("worker ready", model=self.model, consumer=self.settings.consumer, stream=self.bridge.stream)
        self.engine_loop.resync_kv()  # the first KV event: a reset (the index forgets a predecessor's blocks)
        side = [asyncio.create_task(supervise(name, run, self._give_up))
                for name, run in (("reader", self._reader), ("maintenance", self._maintenance), ("kv events", lambda: self.kv.run(self._io_stop)),
                                  ("dashboard", lambda: self.dashboard.run(self._io_stop)),
                                  ("dashboard wake", lambda: self.dashboard.listen(self._io_stop)))]
        cancels = asyncio.create_task(supervise("cancels", self._cancels, self._give_up))
        publisher = asyncio.create_task(supervise("publisher", lambda: self.outbox.run(self._retrying), self._give_up))
        try:
            await engine_finished()
        finally:
            self.engine_loop.finish()
            # The side tasks stop by flag, then by cancel: a cancel that meets redis-py's own read
            # timeout can be lost (the task reads on), a flag is not.
            await stop_tasks([*side, cancels], self._io_stop, grace_s=3.0)
            self.outbox.close()
            await self._flush(publisher)
            try:
                await asyncio.wait_for(self.kv.goodbye(), GOODBYE_S)
                await asyncio.wait_for(self.bridge.leave(), GOODBYE_S)
            except (asyncio.TimeoutError, *REDIS_DOWN):
                pass
            await self.redis.aclose()
            await self._close_engine()
            self._engine_thread.shutdown()
            self._text_thread.shutdown()
        if self.exit_code == 0 and (self.cut or self.outage.cut):
            self.exit_code = EXIT_CUT
        log.info("worker stopped", exit_code=self.exit_code)
        return self.exit_code

    async def _flush(self, publisher: asyncio.Task) -> None:
        """Let the publisher send what is queued, until the drain's time is up (at least a second);
        past it, what Redis has not taken is given up."""
        stop_by = self._stop_by or time.monotonic() + self.settings.drain_timeout_s
        done, _ = await asyncio.wait([publisher], timeout=max(1.0, stop_by - time.monotonic()))
        if not done:
            log.error("events not delivered before the drain timeout (Redis unreachable); stopping without them")
            self.cut = True
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)

    async def _close_engine(self) -> None:
        """The engine loop has returned: let the engine write back its cache (the disk tier)."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.close)
        except Exception as err:  # a broken device cannot be read back: the cache is lost, nothing else
            log.warning("engine close failed; its cache is not written back", error=str(err))

    def _give_up(self, task: str) -> None:
        """A task that keeps failing: stop (in-flight work is aborted) and exit non-zero, so the
        supervisor of the process restarts it; its queue entries go to other workers."""
        log.error("worker stopping: a task keeps failing", task=task)
        self.exit_code = 1
        self.request_stop()
        self._abort_leftovers()
        if task == "publisher":  # nothing can be sent any more: do not wait for the drain
            self.engine_loop.finish()

    def _finish_if_drained(self) -> None:
        if self.stopping.is_set() and not self.inflight:
            self.engine_loop.finish()

    def _abort_leftovers(self) -> None:
        if self.inflight:
            self.cut = True
            log.warning("drain timeout: aborting", requests=list(self.inflight))
            for request_id in self.inflight:
                self.engine_loop.abort(request_id)

    async def _retrying(self, what: str, call):
        delay = 0.05
        while True:
            try:
                result = await call()
            except REDIS_DOWN as err:
                log.warning("redis unavailable", during=what, error=str(err), retry_in_s=delay)
                self.outage.failed()
            except ResponseError as err:
                if "NOGROUP" not in str(err):
                    raise
                await self.bridge.ensure_group()  # Redis came back empty
            else:
                self.outage.reached(self._retrying)
                return result
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ intake
    async def _reader(self) -> None:
        own = await self._retrying("read own pending", lambda: self.bridge.read(100_000, None, own_pending=True))
        for entry in own:
            await self._reclaimed(await self.bridge.with_deliveries(entry))
        while not self.stopping.is_set() and not self._io_stop.is_set():
            count = self.inflight.readable()
            if count <= 0:
                self.inflight.room.clear()
                await self.inflight.room.wait()
                continue
            block = 1000 if not self.inflight else 50
            entries = await self._retrying("read", lambda: self.bridge.read(count, block))
            if self.stopping.is_set():  # the stop came while the read was blocked: these are for another worker
                await self._retrying("hand back", lambda: self.bridge.hand_back(entries))
                break
            for entry in entries:  # one moved from a dead worker's own stream was delivered before
                await (self._reclaimed(entry) if entry.deliveries > 1 else self._accept(entry))
        # Draining: what was routed here and not read yet goes to the others now, not after the drain.
        await self._retrying("give back routed", self.bridge.give_back_unread)

    async def _reclaimed(self, entry: Entry) -> None:
        if entry.deliveries > self.settings.max_deliveries:
            await self._reject(entry, f"gave up after {entry.deliveries} deliveries")
            return
        await self._accept(entry, reclaimed=True)

    async def _accept(self, entry: Entry, reclaimed: bool = False) -> None:
        try:
            req = admit(entry.data, self.model, self.keys)
        except Rejected as err:
            await self._reject(entry, str(err))
            return
        if req.id in self.inflight:
            if self.inflight.get(req.id).entry_id != entry.entry_id:
                # Another entry with a live id: answering it would end the live request's stream.
                await self._reject(entry, f"request id {req.id!r} is already in flight", tell=False)
            return
        flight = InFlight(entry.entry_id, req, deliveries=entry.deliveries)
        if reclaimed and (req.resume is not None or await self.bridge.was_streamed(req.id)):
            # Tokens went out: running again from the prompt could contradict them. The client
            # re-sends it with what it has (``resume``) when it can.
            self.outbox.put([Outgoing(req.reply, lost_event(req, entry.deliveries), entry.entry_id)])
            return
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self._text_thread, self._prompt_ids, req)
        except Exception as err:  # a bad prompt, or a chat template that chokes on these messages
            message = str(err) if isinstance(err, InvalidRequestError) else f"the prompt could not be tokenized: {err}"
            self.outbox.put([Outgoing(req.reply, error_event(req.id, 0, message, delivery=entry.deliveries), entry.entry_id)])
            return
        self.inflight.add(flight)
        self.engine_loop.add(req, ids)

    def _prompt_ids(self, req: WireRequest) -> list[int]:
        if req.messages is not None:
            return encode_chat(self.engine.tokenizer, req.messages)
        return self.engine.encode(req.prompt if req.prompt is not None else req.prompt_token_ids)

    async def _reject(self, entry: Entry, reason: str, tell: bool = True) -> None:
        log.warning("dead-lettered", entry_id=entry.entry_id, reason=reason)
        await self._retrying("dead-letter", lambda: self.bridge.dead_letter(entry, reason))
        salvaged = salvage_reply(entry.data, self.keys) if tell else None
        if salvaged:
            request_id, target = salvaged
            self.outbox.put([Outgoing(target, error_event(request_id, 0, reason))])

    # ------------------------------------------------------------------ engine outputs
    def _outputs_from_engine_thread(self, outputs: list, errors: list[tuple[str, str]]) -> None:
        self._loop.call_soon_threadsafe(self._events_for, outputs, errors)

    def _events_for(self, outputs: list, errors: list[tuple[str, str]]) -> None:
        """One batch of events per engine step, in the I/O thread (the only one touching ``inflight``)."""
        batch = self.inflight.batch_for(outputs, errors)
        if batch:
            self.outbox.put(batch)
        self._finish_if_drained()

    # ------------------------------------------------------------------ output and upkeep
    async def _maintenance(self) -> None:
        while not self._io_stop.is_set():
            await self._retrying("maintenance", self._upkeep)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._io_stop.wait(), self.settings.heartbeat_s)

    async def _upkeep(self) -> None:
        """Heartbeat and metrics; then take over entries of dead workers while there is room."""
        metrics = self.report.metrics()
        metrics["queue_depth"] = self.report.queue_depth = await self.redis.xlen(self.bridge.stream)
        metrics["dead_letters"] = await self.redis.xlen(self.keys.dead_letter(self.model))
        stats = self.stats_line.due(metrics)
        if stats:
            log.info("stats", **stats)
        if self.prometheus:
            self.prometheus.update(metrics)
        await self.adapters.sync()  # before the beat: its WorkerInfo lists what this engine holds now
        beating = self.inflight.beating()
        sent = time.monotonic()
        held = await self.bridge.heartbeat(beating, self.settings.liveness_s, metrics,
                                           self.report.worker_info(metrics).encode())
        self.outbox.beaten(sent)
        self.outbox.let_go(set(beating) - held)
        free = self.inflight.free()
        if not self.stopping.is_set() and free > 0:
            dead = await self.bridge.reclaim_from_dead(free)
            idle = await self.bridge.reclaim(self.settings.claim_idle_ms, free) if free > len(dead) else []
            for entry in dead + idle:
                log.info("reclaimed", entry_id=entry.entry_id, deliveries=entry.deliveries)
                await self._reclaimed(entry)
        if not self.stopping.is_set():
            moved = await self.bridge.adopt_dead_routed()
            if moved:
                log.info("moved a dead worker's routed entries to the model's stream", entries=moved)

    async def _cancels(self) -> None:
        await listen_forever(self.redis, self.keys.cancel(self.model), self._cancel, stop=self._io_stop)

    def _cancel(self, data: bytes) -> None:
        try:
            cancel = WireCancel.decode(data)
        except InvalidRequestError as err:
            log.warning("bad cancel message", error=str(err))
            return
        if cancel.id in self.inflight:
            log.info("cancel", request_id=cancel.id, reason=cancel.reason)
            self.engine_loop.abort(cancel.id)
