"""Progress of a weight load: bytes and tensors, as a bar on a terminal and as log lines otherwise.

The loaders call ``start(tensors, bytes)`` once the checkpoint is checked and
``advance(tensors, bytes)`` per placed parameter. A server's stderr is usually a
log file, where a redrawn bar is noise, so off a terminal the same figures go
to the log at each quarter.
"""

from __future__ import annotations

import logging
import sys
import time


class LoadProgress:
    def __init__(self, desc: str = "Loading weights", log: logging.Logger | None = None, bar: bool | None = None):
        self.desc, self.log = desc, log
        self._want_bar = sys.stderr.isatty() if bar is None else bar
        self._bar = None
        self.tensors = self.total_tensors = self.bytes = self.total_bytes = 0
        self._next_quarter = 1
        self._t0 = time.perf_counter()

    def start(self, tensors: int, nbytes: int) -> None:
        self.total_tensors, self.total_bytes = tensors, nbytes
        self._t0 = time.perf_counter()
        if self._want_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=nbytes, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)

    def advance(self, tensors: int, nbytes: int) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
            self._bar.update(nbytes)
        elif self.log is not None and self.total_bytes and self.bytes * 4 >= self._next_quarter * self.total_bytes:
            self._next_quarter = self.bytes * 4 // self.total_bytes + 1
            self.log.info("%s: %s (%d/%d tensors, %.1f s)", self.desc, self.summary(), self.tensors, self.total_tensors,
                          time.perf_counter() - self._t0)

    def summary(self) -> str:
        return f"{self.bytes / 2**20:,.1f} / {self.total_bytes / 2**20:,.1f} MiB"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
