"""The requests a worker holds, and what it has sent about each. Used on the I/O thread only.

Turns each engine step's outputs into one batch of events (the terminal event acknowledges the
entry), counts what is waiting to start (the reader takes no more than ``read_ahead`` of those),
and lets go of requests whose entries the worker no longer holds: those are computed on until the
engine aborts them, but nothing more is sent or acknowledged for them.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterator

import structlog

from pagedserve.shared.protocol import WireEvent
from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.serve.bridge import Outgoing
from pagedserve.worker.serve.events import InFlight, error_event, event_for

log = structlog.get_logger("pagedserve.worker")


class InFlightTable:
    def __init__(self, max_inflight: int, read_ahead: int, piece: Callable[[int], str]) -> None:
        """``piece``: a token id's text, for the logprobs events carry (``core/scheduling/token_pieces.py``)."""
        self.max_inflight = max_inflight
        self._piece = piece
        self.read_ahead = read_ahead
        self.room = asyncio.Event()  # set when a request starts or ends: the reader may read again
        self.tokens_out = 0  # generated tokens sent, for the metrics
        self._flights: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._flights

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._flights))

    def get(self, request_id: str) -> InFlight | None:
        return self._flights.get(request_id)

    def add(self, flight: InFlight) -> None:
        self._flights[flight.request.id] = flight

    def free(self) -> int:
        return self.max_inflight - len(self._flights)

    def readable(self) -> int:
        """How many entries to read now: room in flight, but no more than ``read_ahead`` requests
        waiting to start, so a worker leaves what it cannot start soon to the other workers."""
        unstarted = sum(not f.started for f in self._flights.values())
        return min(self.free(), self.read_ahead - unstarted)

    def batch_for(self, outputs: list[RequestOutput], errors: list[tuple[str, str]]) -> list[Outgoing]:
        """One step's events, one per request that changed."""
        batch: list[Outgoing] = []
        for request_id, message in errors:
            flight = self._flights[request_id]
            self._send(batch, flight, error_event(request_id, flight.take_seq(), message, delivery=flight.deliveries))
        for out in outputs:
            flight = self._flights.get(out.request_id)
            event = event_for(flight, out, self._piece) if flight else None
            if event is not None:
                self._send(batch, flight, event)
        return batch

    def _send(self, batch: list[Outgoing], flight: InFlight, event: WireEvent) -> None:
        if event.done:
            del self._flights[event.id]
        if event.done or not flight.started:
            flight.started = True
            self.room.set()
        if not flight.orphaned:
            self.tokens_out += sum(len(o.token_ids) for o in event.outputs)
            batch.append(Outgoing(flight.target, event, flight.entry_id))

    def beating(self) -> list[str]:
        """Entry ids to heartbeat: those not let go of."""
        return [f.entry_id for f in self._flights.values() if not f.orphaned]

    def let_go(self, lost_entries: set[str]) -> list[str]:
        """Mark the requests whose entries this worker no longer holds (Redis lost them, or another
        worker took them over while this one stalled); their ids, for the engine to abort. Their
        clients send them again, or the new holder answers: events from here would contradict them."""
        ids = []
        for flight in self._flights.values():
            if flight.entry_id in lost_entries and not flight.orphaned:
                log.warning("entry no longer held; request stopped without events", request_id=flight.request.id,
                            entry_id=flight.entry_id)
                flight.orphaned = True
                ids.append(flight.request.id)
        return ids
