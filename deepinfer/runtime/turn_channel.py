"""The lockstep turns' transport (runtime/lockstep.py): process 0 to every other process through the
key-value store of JAX's coordination service, which ``jax.distributed.initialize`` already runs in
process 0 (no second network channel, no port of our own).

Neither side waits on the store in the engine's path. The leader hands each turn to a sender thread
(one write per follower goes out while its step runs), and each follower's reader thread fetches turn
n + 1 while the engine runs turn n. Turn n of follower p is ``deepinfer/turn/<p>/<n // BLOCK>/<n>``;
the reader deletes a block's directory once past it, so the store holds at most a block per follower
and a follower pays one delete per BLOCK turns.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading

log = logging.getLogger("deepinfer.lockstep")

PREFIX = "deepinfer/turn"
BLOCK = 256  # turns per deleted directory
POLL_MS = 5_000  # a reader's wait for the next turn, repeated while the server idles
AHEAD = 64  # turns a follower's reader fetches before the engine takes them


class TurnChannel:
    def __init__(self, client, process_index: int, process_count: int):
        self.client, self.index, self.count = client, process_index, process_count
        self.sent = 0
        self._outbox: queue.SimpleQueue | None = None  # leader: turns for the sender thread
        self._sender: threading.Thread | None = None
        self._inbox: queue.Queue | None = None  # follower: turns (or the reader's error) in order
        self.failure: BaseException | None = None

    @classmethod
    def from_jax(cls) -> "TurnChannel":
        import jax
        from jax._src import distributed  # the client jax.distributed.initialize made (no public accessor)

        client = distributed.global_state.client
        if client is None or jax.process_count() < 2:
            raise RuntimeError("the lockstep channel needs jax.distributed.initialize(...) with 2 or more processes")
        return cls(client, jax.process_index(), jax.process_count())

    # -- leader ---------------------------------------------------------------------------------

    def publish(self, turn: list) -> None:
        """Queue turn ``sent`` for every follower (returns at once; the sender thread writes it)."""
        if self.failure is not None:
            raise RuntimeError(f"lockstep: the turns cannot reach the other processes: {self.failure}")
        if self._sender is None:
            self._outbox = queue.SimpleQueue()
            self._sender = threading.Thread(target=self._send_loop, name="deepinfer-turns-out", daemon=True)
            self._sender.start()
        self._outbox.put((self.sent, pickle.dumps(turn, protocol=pickle.HIGHEST_PROTOCOL)))
        self.sent += 1

    def flush(self) -> None:
        """Wait until every queued turn is written (then the sender thread ends)."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join()
            self._sender = None

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            n, payload = item
            try:
                for process in range(1, self.count):
                    self.client.key_value_set_bytes(f"{PREFIX}/{process}/{n // BLOCK}/{n}", payload)
            except Exception as e:  # noqa: BLE001 - the binding raises its runtime error type
                log.exception("lockstep: writing turn %d failed", n)
                self.failure = e
                return

    def wait_stopped(self, timeout_s: float = 60.0) -> None:
        """After the stop turn: wait until every follower has read it (a follower still talking to
        the service when process 0 exits is killed by JAX with a fatal error)."""
        self.flush()
        for process in range(1, self.count):
            try:
                self.client.blocking_key_value_get_bytes(f"deepinfer/stopped/{process}", int(timeout_s * 1000))
            except Exception as e:  # noqa: BLE001
                log.warning("lockstep: process %d did not confirm the stop within %g s: %s", process, timeout_s, e)

    # -- follower -------------------------------------------------------------------------------

    def receive(self) -> list:
        """The next turn, waiting as long as it takes (the leader's failure ends this process: the
        coordination service lives in process 0)."""
        if self._inbox is None:
            self._inbox = queue.Queue(AHEAD)
            threading.Thread(target=self._read_loop, name="deepinfer-turns-in", daemon=True).start()
        item = self._inbox.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"lockstep: reading the next turn failed: {item}") from item
        return item

    def acknowledge_stop(self) -> None:
        """A follower has its last turn: the leader may now take the coordination service down."""
        self.client.key_value_set_bytes(f"deepinfer/stopped/{self.index}", b"1")

    def _read_loop(self) -> None:
        n = 0
        try:
            while True:
                turn = pickle.loads(self._get(f"{PREFIX}/{self.index}/{n // BLOCK}/{n}"))
                last = any(op[0] == "stop" for op in turn)
                if last or n % BLOCK == BLOCK - 1:
                    self.client.key_value_delete(f"{PREFIX}/{self.index}/{n // BLOCK}")
                self._inbox.put(turn)
                if last:
                    return
                n += 1
        except Exception as e:  # noqa: BLE001
            self._inbox.put(e)

    def _get(self, key: str) -> bytes:
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(key, POLL_MS)
            except Exception as e:  # noqa: BLE001 - a timeout while the leader idles: ask again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
