"""The HTTP server over two processes (jax.distributed on loopback, 2 fake CPU devices each): rank 0
serves and leads, rank 1 follows its turns (runtime/lockstep.py); one TP4 + EP4 engine spans the
four devices. Its answers are the one-device bundled server's (tests/conftest.py), under
concurrency, with a constrained request, a stop string that aborts mid-stream and a bad request,
and stopping rank 0 stops rank 1 cleanly."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deepinfer.serve.launch import free_port
from tests.conftest import BUNDLED_SERVER_ARGS
from tests.subprocess_env import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "deepinfer-tiny-v4"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    coordinator, port = free_port(), free_port()
    env = cpu_devices_env(2, DEEPINFER_CACHE=str(root / "cache"))
    # the bundled server's settings on a mesh, but one program (a full warm-up: 64-token steps, one
    # block-table width) to keep the start short
    args = [*BUNDLED_SERVER_ARGS, "--token-buckets", "64", "--context-buckets", "none", "--compile-cache", "off", "--no-ui",
            "-tp", "4", "--enable-expert-parallel", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{coordinator}"]
    logs = [str(root / f"rank{r}.log") for r in (0, 1)]
    procs = []
    for rank in (0, 1):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer.serve", *args, "--node-rank", str(rank),
                                           "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            dead = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
            assert not dead, f"rank(s) exited {dead}:\n" + "\n".join(open(f).read()[-3000:] for f in logs)
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the two-rank server did not start:\n" + open(logs[0]).read()[-3000:]
            time.sleep(0.2)
        yield base, procs, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _completion(base: str, prompt: str, **kw) -> tuple[int, dict]:
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0, **kw}, timeout=300)
    return r.status_code, r.json()


REQUESTS = [  # (prompt, extra fields): greedy, seeded sampling with n = 2, a regex constraint
    ("The Python list", {}),
    ("def fibonacci(n):", {}),
    ("Hello! How are", {}),
    ("import os\n", {"max_tokens": 24}),
    ("A dictionary maps", {"temperature": 0.9, "seed": 7, "n": 2}),
    ("The code is ", {"guided_regex": "[A-Z]{2}-[0-9]{3}"}),
]


def _texts(body: dict) -> list[str]:
    return [c["text"] for c in body["choices"]]


def test_two_ranks_answer_as_one_device_does_under_concurrency(two_ranks, bundled_server):
    base = two_ranks[0]
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:  # all in flight together on the mesh
        got = list(pool.map(lambda r: _completion(base, r[0], **r[1]), REQUESTS))
    want = [_completion(bundled_server.base, p, **kw) for p, kw in REQUESTS]
    assert [s for s, _ in got] == [200] * len(REQUESTS), got
    assert [_texts(b) for _, b in got] == [_texts(b) for _, b in want]
    assert all(b["usage"]["completion_tokens"] > 0 for _, b in got)
    import re

    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", _texts(got[-1][1])[0])


def test_a_stop_string_aborts_on_every_rank_and_a_bad_request_harms_nothing(two_ranks):
    base = two_ranks[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is a Python list?"}], "max_tokens": 40,
            "temperature": 0, "stream": True}
    full = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False}, timeout=300).json()
    text = full["choices"][0]["message"]["content"]
    stop = text.split()[2]  # a word inside the answer: the stream ends there and the engine aborts the rest
    events = httpx.post(base + "/v1/chat/completions", json={**body, "stop": [stop]}, timeout=300).text
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == text[:text.index(stop)] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # sampled without a seed: each engine would draw its own; the followers take rank 0's
    status, body = _completion(base, "Once upon a time", temperature=1.0, n=2)
    assert status == 200 and len(body["choices"]) == 2
    status, bad = _completion(base, "x", max_tokens=10**6)
    assert status == 400 and "max_model_len" in bad["error"]["message"]
    again = _completion(base, "The Python list")
    assert again[0] == 200 and again[1]["usage"]["completion_tokens"] == 16
    debug = httpx.get(base + "/debug/engine", timeout=30).json()
    assert debug["running"] == 0 and debug["waiting"] == 0


def test_stopping_rank_0_stops_every_rank(two_ranks):
    _, procs, logs = two_ranks
    procs[0].send_signal(signal.SIGTERM)
    codes = [p.wait(60) for p in procs]
    follower = open(logs[1]).read()
    assert codes[1] == 0, follower[-3000:]
    assert codes[0] in (0, -signal.SIGTERM), open(logs[0]).read()[-3000:]  # uvicorn re-raises the signal it caught
    assert "rank 0 stopped" in follower and "following rank 0" in follower


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT (rank 0's address), got None"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank must be in 0..1 with --nnodes 2, got 2"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--prefix-cache-dir", "x"], "--prefix-cache-dir is not supported with --nnodes > 1"),
    (["--nnodes", "0"], "--nnodes must be at least 1, got 0"),
])
def test_bad_multi_process_flags_are_refused_before_anything_starts(argv, message, capsys):
    from deepinfer.serve.__main__ import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
