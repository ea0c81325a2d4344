"""A hostile client against a real `python -m deepinfer.serve` on loopback: a hand-written nasty corpus
(every answer a 4xx with an OpenAI error body), schemathesis-generated requests from the server's
OpenAPI document (no 5xx), and bystander streams that must come out exactly as when run alone.

One server process serves the module (the tiny random model, byte-level tokenizer: one token per
byte, so equal text and equal token counts mean equal tokens).
"""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx
import pytest

from deepinfer.random_model import ensure_random_model
from tests.server_process import ServerProcess
from tests.sse_client import raw_request, stream_completion

KEY = "fuzz-key"
MODEL = "deepinfer-tiny-random"
VOCAB = 260
LIMIT = 8 + 40  # max-num-seqs + max-waiting
# the same step shapes as tests/test_server.py, so the shared compilation cache serves both
ARGS = ["--served-model-name", MODEL, "--api-key", KEY, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--token-buckets", "8,64", "--max-model-len", "2048", "--max-waiting", "40", "--max-body-bytes", "100000"]
SCHEMATHESIS_EXAMPLES = 25  # per operation and mode: 4 POST operations x 2 modes = 200 requests


@pytest.fixture(scope="module")
def server(server_cache, tmp_path_factory):
    srv = ServerProcess(["--model", ensure_random_model(server_cache), *ARGS], server_cache,
                        str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    srv.stop()


def post(server, path, body=None, raw=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, headers=headers, timeout=60)


def debug(server):
    return server.debug(KEY)


def wait_idle(server, timeout=60):
    return server.wait_idle(KEY, timeout)


def assert_openai_error(r, status=None):
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == r.status_code and err["type"].endswith("Error")
    return err


BYSTANDERS = [{"prompt": [7, 8, 9], "max_tokens": 400}, {"prompt": [40, 41], "max_tokens": 400},
              {"prompt": [100, 3, 5, 7], "max_tokens": 400}]


def greedy(body):
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}


@pytest.fixture(scope="module")
def alone(server):
    """Each bystander run alone, before anything else touches the server."""
    return [stream_completion(server.base, greedy(b), KEY) for b in BYSTANDERS]


class Bystanders:
    """The bystander streams running concurrently in threads while an attack goes on."""

    def __init__(self, server):
        self.results = [None] * len(BYSTANDERS)
        started = threading.Barrier(len(BYSTANDERS) + 1)

        def one(i):
            self.results[i] = stream_completion(server.base, greedy(BYSTANDERS[i]), KEY, on_first=started.wait)

        self.threads = [threading.Thread(target=one, args=(i,)) for i in range(len(BYSTANDERS))]
        for t in self.threads:
            t.start()
        started.wait(120)  # every bystander has its first tokens: they are running

    def check(self, alone):
        for t in self.threads:
            t.join(300)
        for got, ref in zip(self.results, alone):
            assert got.errors == [] and got.done and got.finish_reason == "length"
            assert (got.text, got.completion_tokens) == (ref.text, ref.completion_tokens) == (ref.text, 400)


# -- the six items of the issue, each with its exact answer ---------------------------------------


def test_large_top_k_is_refused_and_bystanders_continue(server, alone):
    """A top_k past int32 used to overflow the plan packer inside engine.step() and fail its whole batch."""
    running = Bystanders(server)
    r = post(server, "/v1/completions", {"prompt": [4, 5], "max_tokens": 4, "top_k": 2147483648})
    err = assert_openai_error(r, 400)
    assert err["message"] == "top_k must be -1 (off), 0 (off) or a positive integer up to 2147483647, got 2147483648"
    r = post(server, "/v1/completions", {"prompt": [4, 5], "max_tokens": 4, "top_k": VOCAB + 1})
    assert assert_openai_error(r, 400)["message"] == f"top_k must be in [-1, {VOCAB}], got {VOCAB + 1}"
    assert post(server, "/v1/completions", {"prompt": [4, 5], "max_tokens": 4, "top_k": VOCAB}).status_code == 200
    running.check(alone)


@pytest.mark.parametrize("depth, opener", [(3000, "["), (10000, "["), (5000, '{"a":'), (33, "[")])
def test_deep_json_is_400(server, depth, opener):
    closer = "]" if opener == "[" else "}"
    raw = ('{"prompt": ' + opener * depth + "1" + closer * depth + "}").encode()
    assert assert_openai_error(post(server, "/v1/completions", raw=raw), 400)["message"] == \
        "request body is nested more than 32 levels deep"


@pytest.mark.parametrize("field", ["max_tokens", "prompt", "seed"])
def test_huge_integers_are_400(server, field):
    value = "9" * 4301
    body = {"prompt": "[1, 2]", "max_tokens": "3"}
    body[field] = f"[{value}]" if field == "prompt" else value
    raw = ("{" + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}").encode()
    err = assert_openai_error(post(server, "/v1/completions", raw=raw), 400)
    assert err["message"] == "an integer in the request body has 4301 digits; at most 20 are allowed"


@pytest.mark.parametrize("n_prompts", [49, 300, 4000])
def test_request_that_can_never_fit_is_400(server, n_prompts):
    r = post(server, "/v1/completions", {"prompt": [[1, 2]] * n_prompts, "max_tokens": 1})
    err = assert_openai_error(r, 400)
    assert err["message"] == f"prompt has {n_prompts} prompts; at most {LIMIT} are allowed" and err["param"] == "prompt"
    r = post(server, "/v1/completions", {"prompt": [[1, 2]] * 4, "max_tokens": 1, "n": 13})
    assert assert_openai_error(r, 400)["message"] == (
        f"the request needs 52 sequences (prompts x n) but this server holds at most {LIMIT} at once "
        "(max-num-seqs 8 + max-waiting 40); split it")


def test_disconnects_are_one_info_line(server):
    """A non-streaming client that goes away, a half-sent body and a stream left mid-way: one INFO
    line each, with the request id, and no traceback."""
    wait_idle(server)
    body = json.dumps(greedy({"prompt": [1, 2, 3], "max_tokens": 2000})).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    raw_request(server.port, head, body, hold_s=0.5, read=False)
    half = head.replace(f"Content-Length: {len(body)}".encode(), b"Content-Length: 5000")
    raw_request(server.port, half, body[:30], hold_s=0.3, read=False)
    cut = stream_completion(server.base, greedy({"prompt": [1, 2, 3], "max_tokens": 2000}), KEY, stop_after=3)
    assert cut.chunks == 3 and not cut.done
    d = wait_idle(server)
    assert sum(d["pages_used"].values()) == 0 and d["slots_used"] == 0
    deadline = time.monotonic() + 10
    while server.log().count("client disconnected") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    lines = [line for line in log.splitlines() if "client disconnected" in line]
    assert len(lines) == 3 and all(" INFO deepinfer.serve: request cmpl-" in line for line in lines), lines
    assert any(line.endswith("client disconnected") for line in lines)
    assert any(line.endswith("client disconnected while sending the body") for line in lines)
    assert any(line.endswith("client disconnected mid-stream") for line in lines)
    for noise in ("Traceback", "Exception in ASGI application", "CancelledError", "ClientDisconnect"):
        assert noise not in log


# -- the corpus -------------------------------------------------------------------------------------

INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "logprobs", "min_tokens", "prompt_logprobs", "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
BAD_INTS = [-2**63, -2, 2**31, 2**32, 2**63, 2**64, 10**20, "x", [1], {"a": 1}, 1.5]
BAD_FLOATS = [-1e30, 1e30, -101, 1e308, "x", [0.5], {}]
BODY_LEVEL = ("request body", "an integer in the request body", "the number", "not valid JSON")


def corpus():
    """(path, json body or raw bytes, must the message name the field?) for every case."""
    cases = []
    for path, base in (("/v1/completions", {"prompt": [1, 2]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for f in INT_FIELDS + (["top_logprobs", "max_completion_tokens"] if "chat" in path else []):
            for v in BAD_INTS:
                if (f == "logprobs" and "chat" in path) or (f == "seed" and v == 2**31):
                    continue  # a boolean there; a valid seed
                cases.append((path, {**base, f: v}, f))
        for f in FLOAT_FIELDS:
            for v in BAD_FLOATS:
                cases.append((path, {**base, f: v}, f))
        for f in FLOAT_FIELDS:
            for c in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400"):
                cases.append((path, ("{" + json.dumps(base)[1:-1] + f', "{f}": {c}' + "}").encode(), None))
        for v in [{"abc": 1}, {"-1": 1}, {"99999999999": 1}, {"1": 1e9}, {"1": "x"}, {str(i): 1 for i in range(49)},
                  {"1": -101}, {"260": 1}, [1], {" 5": 1}, {"1_0": 1}, {"\u0663": 1}]:
            cases.append((path, {**base, "logit_bias": v}, "logit_bias"))
        for v in [[-1], [2**31], [2**40], [260], list(range(16)), "x", [[1]]]:
            cases.append((path, {**base, "stop_token_ids": v}, "stop_token_ids"))
        for v in [[""], ["x"] * 17, ["x" * 257], [1], {"a": "b"}, ""]:
            cases.append((path, {**base, "stop": v}, "stop"))
        for f, v in [("model", "gpt-4"), ("model", 123), ("stream", [1]), ("user", 5), ("frobnicate", 1),
                     ("stream_options", {"include_usage": True, "x": 1}), ("ignore_eos", "maybe"),
                     ("min_tokens", 5000), ("echo", "maybe"), ("best_of", 17), ("priority", 1),
                     ("chat_template_kwargs", {"messages": []}), ("response_format", {"type": "yaml"}),
                     ("response_format", {"type": "json_schema"}), ("guided_regex", "(a"), ("guided_json", {"type": "foo"}),
                     ("guided_choice", []), ("structured_outputs", {"jsn": 1}), ("guided_grammar", "root ::= x"),
                     ("tools", [{"type": "function"}]), ("seed", -1), ("n", 0)]:
            cases.append((path, {**base, f: v}, f))
    for v in [[], [[]], [-1], [VOCAB], [2**31], [[1], [-5]], [1, "a"], [[1, 2], "ab"], {"a": 1}, None, 5,
              "x" * 2100, [1] * 2100, [[1]] * 49, [""], [True]]:
        cases.append(("/v1/completions", {"prompt": v}, "prompt"))
    cases.append(("/v1/completions", {"prompt": [1, 2], "max_tokens": 2047}, "max_tokens"))
    cases.append(("/v1/completions", {"prompt": "a\ud800b"}, "prompt"))
    for v in [[], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
              [{"role": "user", "content": "x", "tool_calls": []}], [{"role": "user", "content": "\ud800"}],
              [{"role": "user", "content": "x" * 2100}]]:
        cases.append(("/v1/chat/completions", {"messages": v}, "messages"))
    for v in [[-1], [2**31], [VOCAB], ["a"], [1.5], "x", None]:
        cases.append(("/detokenize", {"tokens": v}, "tokens"))
    for body in [{}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {"prompt": 5}, {"messages": "x"}]:
        cases.append(("/tokenize", body, None))
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for raw in [b"", b"   ", b"[1, 2]", b'"x"', b"1", b"null", b'{"prompt": ', b'{"prompt": "\xff\xfe"}', b"{,}",
                    b'{"prompt": [1, 2]}}', b"\x00", ("[" * 100000).encode()[:90000], b'{"a": 1e99999}',
                    b'{"prompt": [' + b"9" * 50000 + b"]}", ("{" * 40 + "}" * 40).encode(), b" " * 100001]:
            cases.append((path, raw, None))
    return cases


def test_nasty_corpus(server, alone):
    """Every case is a 4xx with an OpenAI error body naming the field, while bystander streams run
    undisturbed; afterwards nothing is left in flight and every page is free."""
    cases = corpus()
    assert len(cases) > 450
    running = Bystanders(server)
    statuses = collections.Counter()
    wrong = []
    for path, body, field in cases:
        r = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, {"model": MODEL, **body}
                                                                               if "model" not in body else body)
        statuses[r.status_code] += 1
        try:
            err = assert_openai_error(r)
            if field is not None and not err["message"].startswith(BODY_LEVEL):
                assert field in err["message"] or field == (err["param"] or "").split(".")[0], err
        except (AssertionError, ValueError, KeyError) as e:
            wrong.append((path, str(body)[:120], str(e)[:300]))
    assert wrong == [], "\n".join(map(str, wrong))
    running.check(alone)
    d = wait_idle(server)
    assert sum(d["pages_used"].values()) == 0 and d["slots_used"] == 0
    print(f"\nnasty corpus: {len(cases)} cases, statuses {dict(sorted(statuses.items()))}, 5xx 0, hangs 0")


# -- schemathesis ------------------------------------------------------------------------------------


def test_schemathesis_no_server_error(server):
    """Requests generated from the server's own OpenAPI document (valid and invalid bodies for every
    POST operation): not one 5xx. Generation is bounded (SCHEMATHESIS_EXAMPLES per operation and mode)."""
    import hypothesis
    import schemathesis
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(server.base + "/openapi.json")
    statuses = collections.Counter()
    operations = [op.ok() for op in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert sorted(op.path for op in posts) == ["/detokenize", "/tokenize", "/v1/chat/completions", "/v1/completions",
                                              "/v1/responses"]
    for op in posts:
        assert op.body, f"{op.path} publishes no request body"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @hypothesis.settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            def call(case):
                if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # keep valid ones short
                response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=[not_a_server_error])

            call()
    assert sum(statuses.values()) >= 100 and not any(s >= 500 for s in statuses)
    d = wait_idle(server)
    assert sum(d["pages_used"].values()) == 0 and d["slots_used"] == 0
    print(f"\nschemathesis: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
