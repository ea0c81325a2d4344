"""A server on a checkpoint without a tokenizer, and what SIGTERM does to the streams in flight:
they get --shutdown-timeout seconds to finish, then each receives an OpenAI-shaped error event and
[DONE]; new requests meanwhile get 503. The server process is this module's own (it is stopped)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from deepinfer.random_model import ensure_random_model
from tests.server_process import ServerProcess
from tests.sse_client import stream_completion

MODEL = "deepinfer-tiny-random"
TIMEOUT_S = 1.0  # 2040 tokens take ~3 s even on a quiet machine; 20 take well under 1 s


def without_tokenizer(model_dir: str, target: str) -> str:
    """The random model's weights and config, without tokenizer.json."""
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(model_dir):
        if name != "tokenizer.json" and not os.path.exists(os.path.join(target, name)):
            os.symlink(os.path.join(model_dir, name), os.path.join(target, name))
    return target


@pytest.fixture(scope="module")
def server(server_cache, tmp_path_factory):
    model = without_tokenizer(ensure_random_model(server_cache), str(tmp_path_factory.mktemp("no-tokenizer")))
    # the step shapes of tests/test_server.py's server: its compiled programs are reused from the cache
    srv = ServerProcess(["--model", model, "--served-model-name", MODEL, "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "64", "--token-buckets", "8,64", "--max-model-len", "2048",
                         "--shutdown-timeout", str(TIMEOUT_S)],
                        server_cache, str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_without_tokenizer_are_400(server, stream):
    """This used to hang for ever: ChoiceOutput raised before the end-of-stream marker was queued."""
    r = httpx.post(server.base + "/v1/completions", timeout=10,
                   json={"prompt": [1, 2], "stop": ["x"], "max_tokens": 3, "stream": stream})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "stop strings need a tokenizer and this model has none; use stop_token_ids",
                                 "type": "BadRequestError", "param": "stop", "code": 400}
    ok = httpx.post(server.base + "/v1/completions", timeout=30,
                    json={"prompt": [1, 2], "stop_token_ids": [5], "max_tokens": 3})
    assert ok.status_code == 200


def test_sigterm_finishes_short_streams_and_ends_the_rest_with_an_error(server):
    """Last in the module: the server goes away."""
    # without a tokenizer there is no text: logprobs make each step's tokens a chunk of their own
    long = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 2040, "logprobs": 0}
    bodies = [{**long, "prompt": [1, 2]}, {**long, "prompt": [3, 4, 5]}, {**long, "prompt": [9], "max_tokens": 20}]
    results, started = [None] * 3, threading.Barrier(4)

    def one(i):
        results[i] = stream_completion(server.base, bodies[i], on_first=started.wait, timeout=60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(60)
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused = httpx.post(server.base + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "the server is shutting down"
    assert httpx.get(server.base + "/health", timeout=10).status_code == 503
    for t in threads:
        t.join(60)
    ended = time.monotonic() - t_term
    short = results[2]
    assert short.errors == [] and short.done and short.finish_reason == "length" and short.completion_tokens == 20
    for cut in results[:2]:
        assert cut.done and cut.finish_reason is None and cut.chunks > 1  # it ran, then was ended
        assert cut.errors == [{"error": {"message": "generation failed: the server is shutting down",
                                         "type": "InternalServerError", "param": None, "code": 500}}]
    assert TIMEOUT_S <= ended < TIMEOUT_S + 10  # the streams got their time, and not much more
    # uvicorn re-raises the signal once shut down, so the exit status says "terminated by SIGTERM"
    assert server.proc.wait(30) in (0, -signal.SIGTERM)
    log = server.log()
    assert "shutdown timeout: ending 2 sequence(s) with an error" in log and "Application shutdown complete" in log
    assert "Traceback" not in log and "Cancel" not in log
