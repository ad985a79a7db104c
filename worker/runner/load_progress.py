"""Loading's progress, where a user can watch it: tqdm's bar on a terminal; elsewhere (a service's
JSON log) a line at each quarter of the weights, with the seconds so far."""

from __future__ import annotations

import time

import structlog
from tqdm.auto import tqdm


class LoadProgress:
    """Loading's progress: tqdm's bar on a terminal; elsewhere (a service's log) a line at each quarter."""

    QUARTERS = 4

    def __init__(self, bar: tqdm, total: int) -> None:
        self.bar, self.total, self.done, self.said = bar, total, 0, 0
        self.started = time.monotonic()

    def update(self, count: int) -> None:
        self.bar.update(count)
        self.done += count
        if self.bar.disable and self.total and self.done * self.QUARTERS >= (self.said + 1) * self.total:
            self.said = self.done * self.QUARTERS // self.total
            structlog.get_logger("pagedserve.loader").info(
                "loading weights", tensors=f"{self.done}/{self.total}", seconds=round(time.monotonic() - self.started, 1))
