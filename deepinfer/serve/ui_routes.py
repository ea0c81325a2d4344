"""The built-in web page: ``GET /`` (a chat playground and a live dashboard, plain JS in
serve/ui/), its three static files under ``/ui/``, and ``GET /ui/stats.json``, the JSON the
dashboard polls about once a second.

Only the files named in ``ASSETS`` are served (no path from the URL ever reaches the file
system). The page and its files need no API key (the page is where the key is typed in);
the stats do, like /debug/engine. Rates (tokens/s, mean step time) are computed here from
cumulative counters sampled at each poll, so every open page sees the same smoothed numbers.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from deepinfer.serve.checks import check_auth
from deepinfer.serve.errors import APIError

UI_DIR = Path(__file__).with_name("ui")
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# no-cache: the page of a restarted (maybe upgraded) server is fetched again, not taken stale
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


class RateWindow:
    """Cumulative counters sampled at each poll; rates are taken against the oldest sample of the
    last ``span_s`` seconds (smooth, yet a burst shows within a second or two). Several pages
    polling at once only add samples."""

    def __init__(self, span_s: float = 3.0):
        self.span_s = span_s
        self.samples: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, now: float, values: dict[str, float]) -> tuple[float, dict[str, float]] | None:
        """Record a sample; returns the (time, values) to compare with, or None on the first poll."""
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.span_s:
            self.samples.popleft()  # keep one sample at least span_s old: the rate covers span_s
        base = self.samples[0] if self.samples else None
        self.samples.append((now, values))
        if len(self.samples) > 256:  # many pages polling fast: bound the memory
            self.samples.popleft()
        return base if base is not None and now - base[0] > 1e-3 else None


def _metric_totals(registry) -> dict[str, float]:
    """Every sample of the server's registry, summed over labels (one server: one model name)."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def stats(state, window: RateWindow, now: float) -> dict:
    snap = state.engine.snapshot
    m = _metric_totals(state.metrics.registry)
    generated = m.get("deepinfer:generation_tokens_total", 0.0)
    prompt = m.get("deepinfer:prompt_tokens_total", 0.0)
    steps = m.get("deepinfer:engine_steps_total", 0.0)
    host_sum, host_n = m.get("deepinfer:step_host_seconds_sum", 0.0), m.get("deepinfer:step_host_seconds_count", 0.0)
    wait_sum = m.get("deepinfer:step_wait_seconds_sum", 0.0)
    counters = {"generated": generated, "prompt": prompt, "steps": steps, "host_sum": host_sum, "host_n": host_n,
                "wait_sum": wait_sum}
    base = window.add(now, counters)
    rate = {}
    if base is not None:
        dt = now - base[0]
        rate = {k: (counters[k] - base[1][k]) / dt for k in ("generated", "prompt", "steps")}
        dn = host_n - base[1]["host_n"]
        if dn:  # the window's steps; an idle window keeps the whole run's mean (below)
            rate["host"] = (host_sum - base[1]["host_sum"]) / dn
            rate["wait"] = (wait_sum - base[1]["wait_sum"]) / dn
    finished = {}
    for name, value in _labelled(state.metrics.registry, "deepinfer:request_success_total", "finished_reason"):
        finished[name] = int(value)
    pools = {name: {"used": snap.pages_used.get(name, 0), "cached": snap.pages_cached.get(name, 0),
                    "free": snap.pages_free.get(name, 0)} for name in sorted(set(snap.pages_used) | set(snap.pages_free))}
    for p in pools.values():
        p["total"] = p["used"] + p["cached"] + p["free"]
    drafted = snap.num_draft_tokens
    busy = m.get("deepinfer:device_busy_fraction")
    device_s = m.get("deepinfer:step_device_seconds_mean")
    return {
        "model": state.model_name,
        "max_model_len": state.max_model_len,
        "max_num_seqs": state.max_num_seqs,
        "engine_alive": bool(state.engine.alive),
        "draining": bool(state.draining),
        "requests": {"running": snap.running, "waiting": snap.waiting, "in_flight": state.engine.in_system,
                     "finished": sum(finished.values()), "finished_by_reason": finished,
                     "preemptions": snap.num_preemptions},
        "kv": {"usage": snap.kv_usage, "slots_used": snap.slots_used, "pools": pools},
        "tokens": {"generated": int(generated), "prompt": int(prompt),
                   "generated_per_s": rate.get("generated"), "prompt_per_s": rate.get("prompt")},
        "steps": {"total": int(steps), "per_s": rate.get("steps"),
                  "host_ms_mean": _ms(rate.get("host", host_sum / host_n if host_n else None)),
                  "wait_ms_mean": _ms(rate.get("wait", wait_sum / host_n if host_n else None)),
                  # the engine's step timer: the last 256 steps (0 until a step was measured)
                  "device_ms_mean": _ms(device_s) if steps else None,
                  "device_busy_fraction": busy if steps else None},
        "spec_decode": {"num_drafts": snap.num_drafts, "num_draft_tokens": drafted,
                        "num_accepted_tokens": snap.num_accepted_tokens,
                        "acceptance_rate": snap.num_accepted_tokens / drafted if drafted else None,
                        "accepted_per_position": list(snap.accepted_per_position)},
        "prefix_cache": {"queries": snap.prefix_queries, "hits": snap.prefix_hits,
                         "hit_rate": snap.prefix_hits / snap.prefix_queries if snap.prefix_queries else None,
                         "blocks": snap.cached_blocks},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def _labelled(registry, sample: str, label: str):
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == sample:
                yield s.labels.get(label, ""), s.value


def add_ui_routes(app: FastAPI) -> None:
    """The page's routes on app; the rate window lives on app.state (one per app, no module state)."""
    app.state.ui_rates = RateWindow()

    async def page(request: Request):
        state = request.app.state.deepinfer
        html = (UI_DIR / "index.html").read_text(encoding="utf-8")
        # the page shows its API-key field up front when the server wants one
        html = html.replace('data-auth="off"', f'data-auth="{"on" if state.api_key else "off"}"', 1)
        return Response(html, media_type=ASSETS["index.html"], headers=_HEADERS)

    async def asset(request: Request):
        name = request.path_params["file"]
        if name not in ASSETS:
            raise APIError(404, f"no route {request.url.path}")
        return Response((UI_DIR / name).read_bytes(), media_type=ASSETS[name], headers=_HEADERS)

    async def stats_json(request: Request):
        state = request.app.state.deepinfer
        check_auth(state.api_key, request)
        return stats(state, request.app.state.ui_rates, time.monotonic())

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/stats.json", stats_json, methods=["GET"], include_in_schema=False)  # before /ui/{file}
    app.add_api_route("/ui/{file}", asset, methods=["GET"], include_in_schema=False)
