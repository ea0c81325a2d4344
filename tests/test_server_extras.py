"""vLLM's and OpenAI's request extras against the real server on the bundled model (the shared
conftest.bundled_server): echo and max_tokens 0 scoring, /tokenizer_info, best_of, FIM
suffix, return_tokens_as_token_ids, spaces_between_special_tokens, the accepted no-op
fields, and each one's refusals. Every test asserts the field's effect, not only a 200.
(priority and a request's chat_template need server flags: tests/test_server.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "deepinfer-tiny-v4"
PROMPT = "A list in Python is"


def post(srv, path, body, status=200):
    r = httpx.post(srv.base + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def error(srv, path, body) -> tuple[str, str]:
    got = post(srv, path, body, 400)["error"]
    return got["message"], got["param"]


def stream(srv, path, body) -> list[dict]:
    with httpx.stream("POST", srv.base + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.fixture(scope="module")
def prompt_ids(bundled_server):
    return post(bundled_server, "/tokenize", {"prompt": PROMPT})["tokens"]


def test_echo_returns_the_prompt_and_its_logprobs_first(bundled_server, prompt_ids):
    srv = bundled_server
    plain = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1})
    echo = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True})
    scored = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
    p, e = plain["choices"][0], echo["choices"][0]
    assert e["text"] == PROMPT + p["text"]
    n = len(prompt_ids)
    lp = e["logprobs"]
    assert len(lp["tokens"]) == n + 3 and lp["tokens"][n:] == p["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
    assert lp["token_logprobs"][n:] == p["logprobs"]["token_logprobs"]
    listing = scored["choices"][0]["prompt_logprobs"]  # vLLM's prompt_logprobs of the same prompt
    for pos in range(1, n):
        assert lp["token_logprobs"][pos] == listing[pos][str(prompt_ids[pos])]["logprob"]
        assert lp["tokens"][pos] in lp["top_logprobs"][pos]  # the prompt token itself, beside the top one
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert echo["usage"] == plain["usage"]  # the echoed prompt is not generated


def test_max_tokens_0_with_echo_scores_the_prompt_only(bundled_server, prompt_ids):
    srv = bundled_server
    body = {"prompt": [prompt_ids, prompt_ids[:3]], "max_tokens": 0, "echo": True, "logprobs": 0}
    got = post(srv, "/v1/completions", body)
    full = post(srv, "/v1/completions", {**body, "max_tokens": 1})
    assert got["choices"][0]["text"] == PROMPT
    for ids, c, f in zip(body["prompt"], got["choices"], full["choices"]):
        assert c["text"] == post(srv, "/detokenize", {"tokens": ids})["prompt"]  # the prompt, decoded
        assert len(c["logprobs"]["tokens"]) == len(ids)  # the prompt's tokens, nothing generated
        assert c["logprobs"]["token_logprobs"] == f["logprobs"]["token_logprobs"][: len(ids)]
        assert c["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 0 and got["usage"]["prompt_tokens"] == len(prompt_ids) + 3
    chunks = stream(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == PROMPT
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(prompt_ids)
    assert error(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}) == (
        "max_tokens 0 generates nothing: send echo: true to score the prompt", "max_tokens")


def test_streamed_echo_sends_the_prompt_first(bundled_server):
    srv = bundled_server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True}
    whole = post(srv, "/v1/completions", body)["choices"][0]["text"]
    chunks = stream(srv, "/v1/completions", body)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_tokenizer_info_is_the_tokenizers_configuration(bundled_server):
    from deepinfer.default_model import BOS, CHAT_TEMPLATE, EOS

    info = httpx.get(bundled_server.base + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"], info["chat_template"]) == (BOS, EOS, CHAT_TEMPLATE)
    assert info["model_max_length"] == 4096 and info["vocab_size"] == 4096


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(bundled_server):
    srv = bundled_server
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 11, "logprobs": 0}
    candidates = post(srv, "/v1/completions", {**body, "n": 4})["choices"]
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in candidates}
    best = sorted(candidates, key=lambda c: -score[c["text"]])[:2]
    got = post(srv, "/v1/completions", {**body, "n": 2, "best_of": 4})
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in best]
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert got["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in candidates)
    no_lp = post(srv, "/v1/completions", {**body, "n": 2, "best_of": 4, "logprobs": None})
    assert [c["text"] for c in no_lp["choices"]] == [c["text"] for c in best]
    assert all(c["logprobs"] is None for c in no_lp["choices"])
    assert error(srv, "/v1/completions", {**body, "n": 3, "best_of": 2}) == (
        "best_of must be at least n, got best_of=2 and n=3", "best_of")
    assert error(srv, "/v1/completions", {**body, "best_of": 2, "stream": True})[1] == "best_of"


def test_suffix_needs_fim_tokens(bundled_server):
    message, param = error(bundled_server, "/v1/completions", {"prompt": "def f(", "suffix": "return x"})
    assert param == "suffix" and "this model's lacks <｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>" in message


def test_return_tokens_as_token_ids(bundled_server):
    srv = bundled_server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    named = post(srv, "/v1/completions", body)["choices"][0]["logprobs"]
    ids = post(srv, "/v1/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids["tokens"])
    texts = [post(srv, "/detokenize", {"tokens": [int(t.split(":")[1])]})["prompt"] for t in ids["tokens"]]
    assert texts == named["tokens"] and ids["token_logprobs"] == named["token_logprobs"]
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                              "logprobs": True, "return_tokens_as_token_ids": True})
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_spaces_between_special_tokens(bundled_server):
    """Special tokens kept in the text (skip_special_tokens false), forced by a logit bias on <｜User｜>."""
    srv = bundled_server
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "skip_special_tokens": False,
            "logit_bias": {"2": 100}}
    joined = post(srv, "/v1/completions", body)["choices"][0]["text"]
    spaced = post(srv, "/v1/completions", {**body, "spaces_between_special_tokens": True})["choices"][0]["text"]
    unspaced = post(srv, "/v1/completions", {**body, "spaces_between_special_tokens": False})["choices"][0]["text"]
    assert joined == unspaced == "<｜User｜>" * 3
    assert spaced == " ".join(["<｜User｜>"] * 3)


def test_add_generation_prompt_off_leaves_the_assistant_turn_unopened(bundled_server):
    srv = bundled_server
    msgs = [{"role": "user", "content": "Hi"}]
    closed = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "add_generation_prompt": False})
    opened = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    expect = post(srv, "/tokenize", {"messages": msgs, "add_generation_prompt": False})["count"]
    assert closed["usage"]["prompt_tokens"] == expect == opened["usage"]["prompt_tokens"] - 1  # no <｜Assistant｜>


def test_openai_bookkeeping_fields_are_accepted(bundled_server):
    srv = bundled_server
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    plain = post(srv, "/v1/chat/completions", body)
    kept = post(srv, "/v1/chat/completions", {**body, "store": True, "metadata": {"run": "a"}, "service_tier": "auto",
                                              "reasoning_effort": "none"})
    assert kept["choices"][0]["message"] == plain["choices"][0]["message"]  # nothing else changes
    assert kept["service_tier"] == "default" and "service_tier" not in plain
    assert error(srv, "/v1/chat/completions", {**body, "service_tier": "fastest"})[1] == "service_tier"


def test_priority_and_request_templates_need_their_server_flags(bundled_server):
    srv = bundled_server
    assert error(srv, "/v1/completions", {"prompt": PROMPT, "priority": 2}) == (
        "priority 2 needs --scheduling-policy priority (this server schedules fcfs)", "priority")
    message, param = error(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "chat_template": "{{ messages[0].content }}"})
    assert param == "chat_template" and "--trust-request-chat-template" in message
