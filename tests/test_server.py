"""The OpenAI-compatible server, as a real process on loopback, driven by the official `openai` client.

One server (the tiny random model of deepinfer.random_model, small buckets) serves the module.
SIGTERM is tested in tests/test_server_shutdown.py, hostile clients in tests/test_server_fuzz.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.random_model import ensure_random_model
from tests.server_process import ServerProcess

KEY = "test-key-123"
MODEL = "deepinfer-tiny-random"
ARGS = ["--api-key", KEY, "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "8,64",
        "--max-model-len", "2048",
        "--max-waiting", "40", "--max-body-bytes", "20000", "--scheduling-policy", "priority",
        "--trust-request-chat-template"]


@pytest.fixture(scope="module")
def cache(server_cache):
    return server_cache


def random_model_args(cache: str) -> list[str]:
    return ["--model", ensure_random_model(cache), "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def server(cache, tmp_path_factory):
    srv = ServerProcess(random_model_args(cache) + ARGS, cache, str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body=None, *, raw=None, key=KEY, headers=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    if raw is not None:
        return httpx.post(server.base + path, content=raw, headers={**h, "content-type": "application/json"}, timeout=60)
    return httpx.post(server.base + path, json=body, headers=h, timeout=60)


def debug(server):
    return server.debug(KEY)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name") + "}"
                            if len(s.labels) > 1 else "")
            out[key] = s.value
    return out


def wait_idle(server, timeout=30):
    return server.wait_idle(KEY, timeout)


# -- happy paths ---------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


def test_completion_usage_and_stream_agree(server, client):
    prompt = "The quick brown fox"
    n_prompt = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    assert n_prompt == len(prompt.encode())  # byte-level tokenizer: one token per byte
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_chat_stream_and_not(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    rendered = post(server, "/tokenize", {"messages": messages}).json()
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == rendered["count"] and full.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == rendered["count"] + 10
    # The chat template put the conversation in DeepSeek's layout.
    detok = post(server, "/detokenize", {"tokens": rendered["tokens"]}).json()["prompt"]
    assert detok == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello!<｜Assistant｜>"


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    two = client.completions.create(n=2, **kw)
    again = client.completions.create(n=2, **kw)
    one = client.completions.create(n=1, **kw)
    texts = [c.text for c in sorted(two.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(two.choices, key=lambda c: c.index)] == [0, 1]
    assert texts[0] != texts[1]  # each choice has its own seed
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # reproducible
    assert one.choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert two.usage.completion_tokens == 32
    other = client.completions.create(n=1, **{**kw, "seed": 99})
    assert other.choices[0].text != texts[0]


def test_stop_string_across_tokens(client):
    base = dict(model=MODEL, prompt="Stop here:", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=40, **base).choices[0].text
    # a two-character stop string starting at the 10th character; every character is >= 1 token
    stop = next(text[i : i + 2] for i in range(10, 30) if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2])
    got = client.completions.create(max_tokens=40, stop=[stop], **base)
    assert got.choices[0].text == text[: text.find(stop)]
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra.get("stop_reason") == stop
    streamed = client.completions.create(max_tokens=40, stop=stop, stream=True, **base)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]
    # vLLM's include_stop_str_in_output keeps the stop string, streamed or not
    kept = {**base, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    assert client.completions.create(max_tokens=40, stop=[stop], **kept).choices[0].text == text[: text.find(stop) + 2]
    streamed = client.completions.create(max_tokens=40, stop=stop, stream=True, **kept)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop) + 2]


def test_truncate_prompt_tokens_keeps_the_last_ones(client):
    prompt = list(range(40, 60))
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 5}})
    last5 = client.completions.create(prompt=prompt[-5:], **kw)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == last5.choices[0].text
    whole = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == 20  # -1: up to max_model_len
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be -1 or a positive integer, got 0"):
        client.completions.create(prompt=prompt, **{**kw, "extra_body": {"truncate_prompt_tokens": 0}})


def test_continue_final_message_leaves_the_assistant_turn_open(server, client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, the"}]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cont = client.chat.completions.create(messages=msgs, **{**kw, "extra_body": {
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}})
    ids = post(server, "/tokenize", {"messages": msgs[:1]}).json()["tokens"]  # ... up to the assistant marker
    prefix = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    same = client.completions.create(prompt=prefix + "Well, the", **kw)
    assert cont.usage.prompt_tokens == same.usage.prompt_tokens and cont.choices[0].message.content == same.choices[0].text
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]


def test_a_requests_own_chat_template(server, client):
    """--trust-request-chat-template: the request's template renders the prompt, with its kwargs."""
    msgs = [{"role": "user", "content": "hello"}]
    template = "{{ messages[0]['content'] }}{{ ' and ' + extra if extra else '' }}:"
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1,
                                              "chat_template": template, "chat_template_kwargs": {"extra": "more"}}).json()
    assert r["usage"]["prompt_tokens"] == len("hello and more:")  # byte-level: one token per byte
    plain = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens"] == post(server, "/tokenize", {"messages": msgs}).json()["count"]


def test_priority_decides_who_waits(server):
    """--scheduling-policy priority: with the batch full, a later request of lower priority value is
    admitted before an earlier one of higher value (FCFS would admit the earlier one first)."""
    wait_idle(server)
    done: dict[str, float] = {}

    def run(name, priority, max_tokens):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": name, "max_tokens": max_tokens,
                                             "ignore_eos": True, "temperature": 0, "priority": priority})
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    # eight fillers take every slot; the first frees one long before the others
    fillers = [threading.Thread(target=run, args=(f"f{i}", 0, 400 if i == 0 else 1200)) for i in range(8)]
    for t in fillers:
        t.start()
    deadline = time.monotonic() + 30
    while debug(server)["running"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    late = [threading.Thread(target=run, args=("later", 5, 4)), threading.Thread(target=run, args=("urgent", -5, 4))]
    for t, waiting in zip(late, (1, 2)):
        t.start()
        while debug(server)["waiting"] < waiting and time.monotonic() < deadline:
            time.sleep(0.01)
    assert debug(server)["waiting"] == 2 and "f0" not in done
    for t in fillers + late:
        t.join(timeout=120)
    order = sorted(done, key=done.get)
    # urgent took f0's slot and later waited for urgent's (FCFS: later first, then urgent in its slot)
    assert order.index("urgent") < order.index("later") < order.index("f1"), order


def test_models_by_id_and_openai_shaped_404_405(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")
    r = post(server, "/v1/no-such-route", {})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "no route /v1/no-such-route", "type": "NotFoundError", "param": None, "code": 404}
    r = httpx.get(server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"] == "method GET is not allowed on /v1/completions"


def test_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0
        # greedy picks the most likely token (the legacy dict is keyed by text, so byte tokens that
        # all print as U+FFFD collapse: check >=, and equality below in the chat listing)
        assert chosen >= max(top.values()) - 1e-6
        assert sum(2.718281828 ** v for v in top.values()) <= 1 + 1e-5
    assert "".join(lp.tokens) == out.choices[0].text or "\ufffd" in out.choices[0].text
    plp = client.completions.create(model=MODEL, prompt="abc", max_tokens=1, extra_body={"prompt_logprobs": 2})
    listing = plp.choices[0].model_extra["prompt_logprobs"]
    assert listing[0] is None and len(listing) == 3
    for pos, char in ((1, "b"), (2, "c")):
        entry = listing[pos][str(ord(char))]  # byte-level ids: the prompt token itself is listed
        assert entry["decoded_token"] == char and entry["logprob"] <= 0
        assert len(listing[pos]) <= 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content)
    assert all(isinstance(c.bytes, list) and c.bytes for c in content)


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, status, text",
    [
        ("/v1/chat/completions", {"model": MODEL}, 400, "missing field 'messages'"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "unknown role 'wizard'"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 2100}, 400, "2100 tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2045}, 400, "2050 (5 in the prompt, 2045 to generate)"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature must be a number in [0, 100]"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999999]}, 400, "token ids [999999] outside the vocabulary [0, 260)"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "prediction": {"type": "content"}}, 400,
         "unsupported field(s) prediction"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "chat_template": "{% if %}"}, 400, "the chat template is not valid Jinja"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 5}, 400, "presence_penalty must be in [-2, 2]"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"400": 1}}, 400, "logit_bias has token ids [400] outside"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_schema"}}, 400,
         "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model 'gpt-4' does not exist"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be an integer in [1, 16]"),
    ],
)
def test_bad_requests(server, path, body, status, text):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["code"] == status
    assert debug(server)["sequences_in_flight"] == 0  # nothing reached the engine


def test_malformed_bodies(server):
    r = post(server, "/v1/completions", raw=b'{"model": "x", "prompt": ')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", raw=b'{"model": "deepinfer-tiny-random", "prompt": "\xff\xfe"}')
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", raw=b"[1, 2]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", raw=json.dumps({"model": MODEL, "prompt": "x" * 30000}).encode())
    assert r.status_code == 413 and "exceeds the limit of 20000 bytes" in r.json()["error"]["message"]


def test_api_key(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/v1/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # probes need no key


def test_queue_full_gives_503(server):
    """48 sequences fit (8 running + 40 waiting): three n=16 requests fill it, the fourth gets 503.
    Raw sockets hold the three streams open without reading; closing them aborts all 48."""
    body = json.dumps({"model": MODEL, "prompt": "busy", "n": 16, "max_tokens": 2000, "temperature": 1.0,
                       "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(head + body)
            assert s.recv(100).startswith(b"HTTP/1.1 200")
            socks.append(s)
        assert debug(server)["sequences_in_flight"] == 48
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "one more", "max_tokens": 5})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "at capacity (48 sequences in flight, limit 48)" in r.json()["error"]["message"]
    finally:
        for s in socks:
            s.close()  # the clients go away: every sequence is aborted and its pages freed
    d = wait_idle(server)
    assert sum(d["pages_used"].values()) == 0 and d["slots_used"] == 0


# -- concurrency, cancellation, metrics -------------------------------------------------


def test_cancel_frees_pages_others_continue(server, client):
    wait_idle(server)
    long_kw = dict(model=MODEL, max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(prompt="survivor", **long_kw).choices[0].text
    survivor_text = []

    def survivor():
        for c in client.completions.create(prompt="survivor", stream=True, **long_kw):
            survivor_text.append(c.choices[0].text)

    t = threading.Thread(target=survivor)
    t.start()
    victim = client.completions.create(prompt="victim prompt", stream=True, **long_kw)
    it = iter(victim)
    for _ in range(5):
        next(it)
    before = debug(server)
    assert before["running"] == 2 and before["sequences_in_flight"] == 2
    victim.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    # the handler lets go first, then the engine thread takes the abort: wait for both
    while (debug(server)["sequences_in_flight"], debug(server)["running"]) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = debug(server)
    # the victim's slot is free at once (its pages too, but the survivor, ~700 tokens/s, may take
    # a fresh page in the same moment, so the page total alone cannot show it)
    assert after["running"] == 1 and after["slots_used"] == 1
    t.join(120)
    assert "".join(survivor_text) == alone  # the other stream was untouched
    idle = wait_idle(server)
    assert sum(idle["pages_used"].values()) == 0 and idle["slots_used"] == 0
    assert metrics(server)["deepinfer:request_success_total{finished_reason=abort}"] >= 1


def test_32_concurrent_streams_equal_sequential(server):
    wait_idle(server)
    prompts = [f"Request number {i}: " + "ab" * (i % 7) for i in range(32)]
    lengths = [8 + (i * 5) % 17 for i in range(32)]
    aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(p, n):
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    concurrent = asyncio.run(all_at_once())
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    sequential = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
                  for p, n in zip(prompts, lengths)]
    assert concurrent == sequential
    assert len(set(sequential)) > 20  # the prompts lead to different outputs


def test_metrics_move(server, client):
    before = metrics(server)
    out = client.completions.create(model=MODEL, prompt="count me", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["deepinfer:generation_tokens_total"] - before["deepinfer:generation_tokens_total"] == 7
    assert after["deepinfer:prompt_tokens_total"] - before["deepinfer:prompt_tokens_total"] == out.usage.prompt_tokens
    key = "deepinfer:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    assert after["deepinfer:time_to_first_token_seconds_count"] == before["deepinfer:time_to_first_token_seconds_count"] + 1
    assert after["deepinfer:inter_token_latency_seconds_count"] - before["deepinfer:inter_token_latency_seconds_count"] == 6
    assert after["deepinfer:e2e_request_latency_seconds_count"] > before["deepinfer:e2e_request_latency_seconds_count"]
    assert after["deepinfer:engine_steps_total"] > before["deepinfer:engine_steps_total"]
    wait_idle(server)
    idle = metrics(server)
    assert idle["deepinfer:num_requests_running"] == 0 and idle["deepinfer:num_requests_waiting"] == 0
    assert idle["deepinfer:kv_cache_usage_perc"] == 0 and idle["deepinfer:kv_pages_used"] == 0
    assert 0 < idle["deepinfer:device_busy_fraction"] <= 1 and idle["deepinfer:step_device_seconds_mean"] > 0
