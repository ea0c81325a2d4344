"""The built-in web page (serve/ui_routes.py, serve/ui/): its routes on a fake state, and the page
itself in a real headless browser against the bundled server (a chat that streams, a dashboard
whose counters move, nothing fetched from outside the server).

The browser is Debian's chromium driven by playwright (no playwright browser download: these
machines have no internet). DEEPINFER_UPDATE_SCREENSHOTS=1 writes the README's screenshots to
docs/; otherwise they go to a temporary folder, so a test run leaves the tree clean.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from deepinfer.runtime.engine_stats import EngineStats
from deepinfer.serve.api import build_app
from deepinfer.serve.metrics import ServerMetrics

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _fake_state(ui: bool, api_key: str | None = None):
    """What the page's routes read of a ServerState, with no engine behind it."""
    snap = EngineStats(running=1, waiting=2, kv_usage=0.25, pages_used={"swa": 3}, pages_cached={"swa": 1},
                       pages_free={"swa": 12}, num_draft_tokens=10, num_accepted_tokens=7)
    engine = SimpleNamespace(snapshot=snap, in_system=3, alive=True)
    return SimpleNamespace(ui=ui, api_key=api_key, engine=engine, metrics=ServerMetrics("m"), model_name="m",
                           max_model_len=128, max_num_seqs=4, draining=False)


def test_no_ui_is_an_openai_404():
    client = TestClient(build_app(_fake_state(ui=False)))
    for path in ("/", "/ui/app.js", "/ui/stats.json"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {path}"


def test_ui_routes_on_a_fake_state():
    state = _fake_state(ui=True, api_key="sekrit")
    client = TestClient(build_app(state))
    page = client.get("/")  # the page itself needs no key: it is where the key is typed in
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-auth="on"' in page.text and "/ui/app.js" in page.text
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("index.html", "text/html")):
        r = client.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
    for name in ("nope.js", "..%2Fapi.py", "%2E%2E%2Fui_routes.py"):
        r = client.get(f"/ui/{name}")
        assert r.status_code == 404 and "error" in r.json(), name
    assert client.get("/ui/stats.json").status_code == 401
    auth = {"Authorization": "Bearer sekrit"}
    state.metrics.generation_tokens.inc(5)
    first = client.get("/ui/stats.json", headers=auth).json()
    assert first["tokens"]["generated"] == 5 and first["tokens"]["generated_per_s"] is None  # no rate from one sample
    assert first["requests"] == {"running": 1, "waiting": 2, "in_flight": 3, "finished": 0, "finished_by_reason": {},
                                 "preemptions": 0}
    assert first["kv"]["pools"] == {"swa": {"used": 3, "cached": 1, "free": 12, "total": 16}}
    assert first["spec_decode"]["acceptance_rate"] == pytest.approx(0.7)
    state.metrics.generation_tokens.inc(10)
    state.metrics.finished("stop")
    second = client.get("/ui/stats.json", headers=auth).json()
    assert second["tokens"]["generated_per_s"] > 0 and second["requests"]["finished"] == 1
    assert "/" not in client.get("/openapi.json").json()["paths"]  # no fuzzing of the page's routes


def test_stats_json_of_the_bundled_server(bundled_server):
    s = httpx.get(bundled_server.base + "/ui/stats.json", timeout=30).json()
    assert s["model"] == "deepinfer-tiny-v4" and s["engine_alive"] is True
    assert set(s) >= {"requests", "kv", "tokens", "steps", "spec_decode", "prefix_cache"}
    assert set(s["requests"]) >= {"running", "waiting", "in_flight", "finished"}
    assert s["kv"]["pools"] and all(set(p) == {"used", "cached", "free", "total"} for p in s["kv"]["pools"].values())
    assert set(s["steps"]) >= {"host_ms_mean", "device_ms_mean", "device_busy_fraction", "per_s"}
    assert set(s["spec_decode"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate"}
    r = httpx.get(bundled_server.base + "/", timeout=30)
    assert r.status_code == 200 and 'data-auth="off"' in r.text


@pytest.fixture(scope="module")
def browser():
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


# records the answer's length at every change of the chat, to tell a stream from one late write
_WATCH_ANSWER = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const a = document.querySelector('.msg.assistant:last-of-type .answer');
    if (a) window.__lengths.push(a.textContent.length);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


def _background_chats(base: str, seconds: float, clients: int = 3) -> list[threading.Thread]:
    """Chats from `clients` threads for `seconds` (one more than the shared server's 2 slots, so one
    waits), behind one long system prompt (prefix-cache hits): the README's dashboard screenshot
    then shows an engine at work."""
    end = time.monotonic() + seconds
    system = "You are a helpful assistant who answers questions about Python. " * 24

    def chat(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < end:
                c.post(base + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Tell me about Python's list type ({i})."}],
                    "max_tokens": 48, "temperature": 0.8})

    threads = [threading.Thread(target=chat, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def test_page_streams_a_chat_and_the_dashboard_moves(bundled_server, browser, tmp_path):
    base = bundled_server.base
    updating = os.environ.get("DEEPINFER_UPDATE_SCREENSHOTS") == "1"
    out = DOCS if updating else tmp_path
    out.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1,
                                  color_scheme="light")
    page = context.new_page()
    urls, errors = [], []
    page.on("request", lambda r: urls.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    t0 = time.monotonic()
    page.goto(base + "/")
    page.wait_for_function("window.deepinferUI && window.deepinferUI.polls >= 1", timeout=10_000)
    assert page.text_content("#model-name") == "deepinfer-tiny-v4"
    before = page.evaluate("window.deepinferUI.stats")

    page.evaluate(_WATCH_ANSWER)
    page.fill("#max_tokens", "24")
    page.fill("#temperature", "0")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    page.wait_for_function("window.deepinferUI.chunks > 0", timeout=20_000)
    page.wait_for_function("!window.deepinferUI.busy", timeout=20_000)
    answer = page.locator(".msg.assistant .answer").last.text_content()
    meta = page.locator(".msg.assistant .meta").last.text_content()
    assert answer and "(no answer)" not in answer, meta
    assert "tokens" in meta and "finish:" in meta, meta
    lengths = page.evaluate("window.__lengths")
    grew = sorted(set(n for n in lengths if n > 0))
    assert len(grew) >= 2 and grew[-1] == len(answer), lengths  # the text arrived in pieces: streamed
    assert page.evaluate("window.deepinferUI.chunks") >= 2
    page.screenshot(path=str(out / "ui-chat.png"))

    page.click("#tab-dash")
    assert page.is_visible("#view-dash") and not page.is_visible("#view-chat")
    generated = before["tokens"]["generated"]
    finished = before["requests"]["finished"]
    page.wait_for_function(f"window.deepinferUI.stats.tokens.generated > {generated} && "
                           f"window.deepinferUI.stats.requests.finished > {finished}", timeout=10_000)
    page.wait_for_function(f"document.getElementById('s-generated').textContent.replace(/,/g, '') > {generated}",
                           timeout=5_000)
    assert int(page.text_content("#s-finished").replace(",", "")) > finished
    assert page.locator("#pools .pool").count() == len(before["kv"]["pools"])
    if updating:  # the README's picture: some seconds of traffic, taken while it runs
        load = _background_chats(base, seconds=10)
        page.wait_for_timeout(8_000)
    page.screenshot(path=str(out / "ui-dashboard.png"))
    context.close()
    if updating:
        for t in load:
            t.join()

    outside = [u for u in urls if not (u.startswith(base + "/") or u.startswith("data:"))]
    assert not outside, outside  # offline: nothing from a CDN, no external fonts
    assert {base + "/", base + "/ui/app.js", base + "/ui/style.css"} <= set(urls)
    assert not errors, errors
    assert updating or time.monotonic() - t0 < 40


def test_page_sends_the_knobs_and_shows_reasoning(bundled_server, browser):
    """The request the page builds (knobs, schema, thinking, key) and the reasoning block, against
    a canned stream (playwright answers the POST: no engine involved)."""
    import json

    sent = []
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "a city."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": '{"city": '}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": '"Paris"}'}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(route):
        sent.append((route.request.post_data_json, route.request.headers.get("authorization")))
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=stream)

    context = browser.new_context()
    page = context.new_page()
    page.route("**/v1/chat/completions", answer)
    page.goto(bundled_server.base + "/")
    page.evaluate("document.body.dataset.auth = 'on'")  # as after a 401
    page.fill("#api-key", "k-123")
    for field, value in (("#temperature", "0.5"), ("#top_p", "0.9"), ("#top_k", "40"), ("#max_tokens", "16"),
                         ("#seed", "7"), ("#system", "Be brief.")):
        page.fill(field, value)
    page.click("#schema-example")
    page.check("#thinking", force=True)  # the checkbox is styled as a switch (its input is transparent)
    page.fill("#thinking_budget", "12")
    page.fill("#prompt", "Where?")
    page.press("#prompt", "Enter")
    page.wait_for_function("window.deepinferUI.chunks >= 6 && !window.deepinferUI.busy", timeout=10_000)
    body, auth = sent[0]
    assert auth == "Bearer k-123" and page.evaluate("localStorage.getItem('deepinfer.apiKey')") == "k-123"
    assert body["stream"] is True and body["chat_template_kwargs"] == {"thinking": True}
    assert body["thinking_token_budget"] == 12
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")} == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "max_tokens": 16, "seed": 7}
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"}]
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["city", "country"]
    assert page.text_content(".msg.assistant .answer") == '{"city": "Paris"}'
    assert page.text_content(".reasoning .thought") == "The user wants a city."
    assert page.evaluate("document.querySelector('.reasoning').open") is False  # folded once the answer began
    assert "6 tokens" in page.text_content(".msg.assistant .meta")
    context.close()


def test_page_shows_the_servers_reasoning(bundled_server, browser):
    """Thinking against the real server: the budget ends the bundled model's reasoning, whose text the
    page shows in its block exactly as the server's non-streamed reasoning_content."""
    import httpx

    body = {"messages": [{"role": "user", "content": "What is a list?"}], "max_tokens": 12, "temperature": 0.8,
            "seed": 1, "chat_template_kwargs": {"thinking": True}, "thinking_token_budget": 3}
    expected = httpx.post(bundled_server.base + "/v1/chat/completions", json=body, timeout=60).json()
    thought = expected["choices"][0]["message"]["reasoning_content"]
    context = browser.new_context()
    page = context.new_page()
    page.goto(bundled_server.base + "/")
    page.fill("#max_tokens", "12")
    page.fill("#temperature", "0.8")
    page.fill("#seed", "1")  # seeded sampling: the same tokens as the request above
    page.check("#thinking", force=True)
    page.fill("#thinking_budget", "3")
    page.fill("#prompt", "What is a list?")
    page.click("#send")
    page.wait_for_function("window.deepinferUI.chunks > 0 && !window.deepinferUI.busy", timeout=20_000)
    assert thought and page.text_content(".reasoning .thought") == thought
    assert page.text_content(".msg.assistant .answer") == expected["choices"][0]["message"]["content"]
    context.close()
