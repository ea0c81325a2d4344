"""Per-step timing of the engine loop: host time, device time, device-busy fraction.

The host side is timed directly (``step()`` minus the time it blocked on device
results). The device side is seen from a watcher thread that blocks on each
dispatched step's output in order and stamps when it became ready: step N ran on
the device from max(dispatch N, ready N-1) to ready N (steps execute in order).
Busy fraction = device time / wall time since the first dispatch of the window.
This needs one thread wake per step, so it is opt-in (``EngineConfig.measure_device``).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass


@dataclass
class StepTimes:
    dispatch: float
    ready: float
    device: float  # seconds the device spent on this dispatch
    steps: int = 1  # model steps in it (a decode burst runs several)


class StepTimer:
    def __init__(self, window: int = 256):
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self.done: collections.deque[StepTimes] = collections.deque(maxlen=window)
        self._last_ready = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="deepinfer-step-timer", daemon=True)
        self._thread.start()

    def dispatched(self, array, steps: int = 1) -> None:
        """Call right after dispatching a step (or a burst of ``steps``), with one of its output arrays."""
        self._pending.put((time.perf_counter(), array, steps))

    def _watch(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            dispatch, array, steps = item
            try:
                array.block_until_ready()
            except Exception:  # a failed step: the engine reports it; nothing to time
                continue
            ready = time.perf_counter()
            start = max(dispatch, self._last_ready)
            self._last_ready = ready
            with self._lock:
                self.done.append(StepTimes(dispatch, ready, ready - start, steps))

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every dispatched step has been stamped."""
        deadline = time.perf_counter() + timeout
        while not self._pending.empty() and time.perf_counter() < deadline:
            time.sleep(0.001)
        time.sleep(0.002)

    def summary(self) -> dict:
        """Device seconds per model step (mean; a burst counts its steps) and the busy fraction over the
        recorded window."""
        with self._lock:
            steps = list(self.done)
        if len(steps) < 2:
            return {"steps": len(steps), "device_s_per_step": None, "busy_fraction": None}
        wall = steps[-1].ready - steps[0].dispatch
        busy = sum(s.device for s in steps)
        n = sum(s.steps for s in steps)
        return {"steps": n, "device_s_per_step": busy / n, "busy_fraction": min(1.0, busy / wall)}

    def reset(self) -> None:
        with self._lock:
            self.done.clear()

    def close(self) -> None:
        self._pending.put(None)
