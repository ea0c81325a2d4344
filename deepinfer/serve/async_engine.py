"""The engine loop in its own thread, and an asyncio face for the HTTP handlers.

Only the engine thread touches the LLMEngine. Handlers send commands (add,
abort) through a thread-safe queue; the thread drains them between steps, runs
a step whenever there is work, and pushes each request's new tokens into that
request's asyncio queue (``loop.call_soon_threadsafe``). Detokenization, stop
strings and response formatting happen on the asyncio side, so the engine
thread only schedules and steps.

A failing step fails only the request(s) that made it fail (their streams get the
error; the engine finds them, runtime/recovery.py) and the loop goes on serving;
bad input is rejected by the handlers before it gets here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from deepinfer.runtime.engine import EngineStats, LLMEngine, StepFailed
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.text.output import TokenLogprobs, take_new

log = logging.getLogger("deepinfer.serve")


@dataclass
class Update:
    """New output of one sequence, as the engine thread saw it."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None
    error: str | None = None
    time: float = 0.0
    first_scheduled_time: float | None = None
    prompt_logprobs: dict | None = None  # with the first update, when the request asked for them
    num_cached_tokens: int = 0  # prompt tokens the prefix cache let the request skip


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    req: object | None = None
    sent: int = 0

    def push(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, update)


@dataclass(frozen=True)
class AddRequest:
    """asyncio side -> engine thread: start a sequence whose updates go to ``stream``."""

    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    stream: _Stream
    compiled_grammar: object = None  # structured outputs: compiled by the handler, off this thread
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share entries
    priority: int = 0  # --scheduling-policy priority: lower is scheduled first


@dataclass(frozen=True)
class AbortRequest:
    """asyncio side -> engine thread: end a sequence now (client gone, stop string, shutdown)."""

    request_id: str
    reason: str = "abort"


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.snapshot = EngineStats()  # the engine's last stats, refreshed by the engine thread
        self._preemptions_seen = 0
        self.in_system = 0  # sequences submitted and not yet finished (asyncio side)
        self.log_interval_s = 10.0  # the periodic capacity line while there is work
        self._last_log = 0.0

    # -- asyncio side ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still in flight ("server shutting down") and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine.warming is not None:  # a background compile must not outlive the server
            self.engine.warming.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams, compiled_grammar=None,
                       cache_salt: str | None = None, priority: int = 0):
        """Yield Updates for one sequence until it finishes. Leaving early (client gone,
        stop string) aborts it in the engine, which frees its pages at once."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        self.in_system += 1
        self._send(AddRequest(request_id, prompt_ids, sp, stream, compiled_grammar, cache_salt, priority))
        done = False
        try:
            while not done:
                update = await stream.queue.get()
                done = update.finish_reason is not None or update.error is not None
                yield update
        finally:
            self.in_system -= 1
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._send(AbortRequest(request_id, reason))

    def _send(self, cmd: AddRequest | AbortRequest) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # -- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._turn():
                    return
            except Exception as e:  # a host-side bug: fail everything in flight (no stream waits for ever), keep serving
                log.exception("engine loop error")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _turn(self) -> bool:
        """One turn of the loop: commands, then a step if there is work. True once stopped."""
        engine = self.engine
        self._drain()
        if self._stopping:
            self._fail_all("the server is shutting down")
            return True
        if not engine.has_unfinished:
            self._refresh()
            self._wake.wait(0.5)
            self._wake.clear()
            return False
        try:
            engine.step()
        except StepFailed as e:
            for req in e.failed:
                self._finish_stream(req, error=f"engine step failed: {req.error}")
            self._push_updates()  # bystanders that got tokens while the culprit was sought
            return False
        if self.metrics is not None:
            self.metrics.step_host_time.observe(engine.last_host_s)
            self.metrics.step_wait_time.observe(engine.last_wait_s)
            self.metrics.num_steps.inc()
            if engine.last_mask_fill_s:
                self.metrics.mask_fill_time.observe(engine.last_mask_fill_s)
        self._push_updates()
        self._refresh()
        return False

    def _push_updates(self) -> None:
        now = time.monotonic()
        for req in self.engine.updated:  # includes the requests that finished
            stream = self._streams.get(req.request_id)
            if stream is None:
                continue
            ids, lps, reason = take_new(req, stream.sent)
            stream.sent += len(ids)
            if ids or reason:
                plp = None
                if stream.sent == len(ids) and req.sampling_params.prompt_logprobs is not None:
                    plp = dict(req.prompt_logprobs)  # the prompt is done once the first token exists
                stream.push(Update(ids, lps, reason, None, now, req.first_scheduled_time, plp, req.num_cached_tokens))
            if reason:
                del self._streams[req.request_id]

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                stream = cmd.stream
                try:
                    stream.req = self.engine.add_request(cmd.prompt_ids, cmd.sampling_params, request_id=cmd.request_id,
                                                         compiled_grammar=cmd.compiled_grammar, cache_salt=cmd.cache_salt,
                                                         priority=cmd.priority)
                except Exception as e:  # the handlers validate first; this is the last line
                    stream.push(Update([], [], None, f"{type(e).__name__}: {e}", time.monotonic()))
                    continue
                self._streams[cmd.request_id] = stream
            elif isinstance(cmd, AbortRequest):
                stream = self._streams.pop(cmd.request_id, None)
                if stream is not None and stream.req is not None and not stream.req.is_finished:
                    self.engine.abort(stream.req, cmd.reason)

    def _finish_stream(self, req, error: str) -> None:
        stream = self._streams.pop(req.request_id, None)
        if stream is not None:
            stream.push(Update([], [], None, error, time.monotonic()))

    def _fail_all(self, error: str) -> None:
        for rid, stream in list(self._streams.items()):
            if stream.req is not None and not stream.req.is_finished:
                try:
                    self.engine.abort(stream.req, "error")
                except Exception:  # keep failing the others
                    log.exception("abort failed for %s", rid)
            stream.push(Update([], [], None, error, time.monotonic()))
        self._streams.clear()

    def _refresh(self) -> None:
        snap = self.engine.stats()
        m = self.metrics
        if m is not None:
            m.num_requests_running.set(snap.running)
            m.num_requests_waiting.set(snap.waiting)
            m.kv_cache_usage_perc.set(snap.kv_usage)
            m.kv_pages_used.set(sum(snap.pages_used.values()))
            m.num_preemptions.inc(snap.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = snap.num_preemptions
            last = self.snapshot
            m.prefix_cache_queries.inc(snap.prefix_queries - last.prefix_queries)
            m.prefix_cache_hits.inc(snap.prefix_hits - last.prefix_hits)
            m.kv_pages_cached.set(sum(snap.pages_cached.values()))
            m.spec_decode_num_drafts.inc(snap.num_drafts - last.num_drafts)
            m.spec_decode_num_draft_tokens.inc(snap.num_draft_tokens - last.num_draft_tokens)
            m.spec_decode_num_accepted_tokens.inc(snap.num_accepted_tokens - last.num_accepted_tokens)
            before = last.accepted_per_position or (0,) * len(snap.accepted_per_position)
            for i, (now, was) in enumerate(zip(snap.accepted_per_position, before)):
                m.accepted_at(i).inc(now - was)
            timer = self.engine.step_timer
            if timer is not None:
                summary = timer.summary()
                if summary["busy_fraction"] is not None:
                    m.device_busy_fraction.set(summary["busy_fraction"])
                    m.step_device_time.set(summary["device_s_per_step"])
        self.snapshot = snap  # last: whoever sees this snapshot sees the gauges it set
        now = time.monotonic()
        if (snap.running or snap.waiting) and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            rate = snap.prefix_hits / snap.prefix_queries if snap.prefix_queries else 0.0
            log.info("running %d, waiting %d; KV pages used %d, cached %d, free %d; prefix cache hit rate %.1f%% "
                     "(%d of %d prompt tokens)", snap.running, snap.waiting, sum(snap.pages_used.values()),
                     sum(snap.pages_cached.values()), sum(snap.pages_free.values()), 100 * rate, snap.prefix_hits,
                     snap.prefix_queries)
