"""The bundled default model (deepinfer/assets/deepinfer-tiny-v4): format, numerics, tokenizer, behaviour.

Its weights are trained (scripts/tiny_model), so these tests also pin what it says:
a greedy completion of a fixed prompt is an exact regression guard — retraining the
model means updating EXPECTED_* here and the README's example together.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.default_model import ASSISTANT, BOS, EOS, NAME, USER, default_model_dir
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.models.deepseek_v4.model import forward_with_intermediates
from deepinfer.models.deepseek_v4.mtp import mtp_forward
from deepinfer.text.tokenizer import TextTokenizer

MODEL_DIR = default_model_dir()

TEXT = (
    "Return a new list containing all items from the iterable in ascending order.\n\n"
    "A custom key function can be supplied to customize the sort order, and the reverse flag "
    "can be set to request the result in descending order."
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(MODEL_DIR, mtp="require")


def test_layout_and_size():
    names = sorted(os.listdir(MODEL_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "TRAINING.md",
            "loss.png", "training_log.json", "corpus_manifest.json"} <= set(names)
    raw = json.load(open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8"))
    assert raw["model_type"] == "deepseek_v4" and raw["architectures"] == ["DeepseekV4ForCausalLM"]
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names)
    assert total <= 25 * 2**20, f"bundled model is {total / 2**20:.1f} MiB"


def test_every_v4_feature_is_present(checkpoint):
    cfg, params = checkpoint
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"} and cfg.n_shared_experts == 1
    assert cfg.hc_mult == 4 and cfg.num_nextn_predict_layers == 1 and "mtp" in params


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties broken towards the lower index, as lax.top_k breaks them."""
    import torch

    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def test_logits_equal_transformers(checkpoint, tokenizer, monkeypatch):
    """fp32 logits equal transformers' DeepseekV4ForCausalLM on the bundled checkpoint.

    The trained indexer's ReLU scores are often exactly 0 for several rows, so its top-k
    meets exact ties (5 of the 147 positions of TEXT * 3). torch.topk leaves the order of
    ties unspecified; lax.top_k takes the lower index. Short prompts (at most 16 visible
    rows: no selection) are compared as they are; the long one with the reference's
    topk breaking ties the same documented way.
    """
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV4ForCausalLM

    cfg, params = checkpoint
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # transformers has no MTP module: those tensors are the only ones it may leave unused
    assert not info["missing_keys"] and not info["mismatched_keys"]

    # jitted: op by op the three prompts took 26-37 s each, compiled 4.5-5.8 s (2026-12-07)
    forward = jax.jit(forward_with_intermediates, static_argnums=0)

    def check(ids):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits.numpy()[0]
        got, _, _ = forward(cfg, params, jnp.asarray([ids], jnp.int32))
        got = np.asarray(got)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        assert (got.argmax(-1) == want.argmax(-1)).all()

    short = [tokenizer.encode(tokenizer.apply_chat_template(CHAT)), tokenizer.encode(TEXT)]
    assert all(len(ids) < cfg.index_topk * cfg.csa_compress_ratio for ids in short)
    for ids in short:
        check(ids)
    long = tokenizer.encode(TEXT * 3)
    assert (len(long) + 1) // cfg.csa_compress_ratio > 2 * cfg.index_topk  # selection really happens
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    check(long)


@pytest.mark.parametrize("text", [
    TEXT,
    "def f(x):\n    return {'a': [1, 2.5, None]}  # tabs\tand  spaces  ",
    "Ünïcödé, 中文, emoji 🙂, and a NUL \x00 byte",
    '{"name": "Alice", "age": 31}',
    "",
])
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_tokenizer_compresses_english(tokenizer):
    """A trained BPE, not bytes: English prose takes fewer than one token per 3 characters (measured: 4.5)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) < len(TEXT) / 3


def test_special_tokens_and_chat_template(tokenizer):
    tok = tokenizer.tokenizer
    assert [tok.token_to_id(t) for t in (BOS, EOS, USER, ASSISTANT)] == [0, 1, 2, 3]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sort [3, 1, 2]"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello!{EOS}{USER}Sort [3, 1, 2]{ASSISTANT}"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 0 and ids[-1] == 3 and ids.count(2) == 2 and ids.count(1) == 1
    # transformers renders the same template from tokenizer_config.json to the same ids
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    assert hf.encode(rendered, add_special_tokens=False) == ids


def test_mtp_block_predicts_the_models_next_next_token(checkpoint, tokenizer):
    """The MTP head was trained: its top-1 for t+2 (given the true t+1) usually matches the
    main model's own top-1 at t+1 — what speculative decoding's acceptance rests on."""
    cfg, params = checkpoint
    ids = jnp.asarray([tokenizer.encode(TEXT * 2)], jnp.int32)
    logits, streams, _ = jax.jit(forward_with_intermediates, static_argnums=0)(cfg, params, ids)  # jitted: see above
    positions = jnp.arange(ids.shape[1] - 1, dtype=jnp.int32)[None]
    mtp_logits, _ = jax.jit(mtp_forward, static_argnums=(0, 2))(cfg, params, 0, streams[:, :-1], ids[:, 1:], positions)
    agree = float((mtp_logits.argmax(-1) == logits[:, 1:].argmax(-1)).mean())
    assert agree > 0.5, agree


# Regression guard: greedy continuation of a fixed prompt through LLM() with no model argument.
PROMPT = "The built-in function sorted"
EXPECTED_IDS = [532, 289, 202, 1621, 1214, 272, 811, 371, 263, 532, 17, 202, 202, 453, 310, 948, 598, 532, 289, 263,
                532, 443, 15, 330]
EXPECTED_TEXT = " function is\nbefore the same as a function.\n\nTheseparated function is a function object, and"


def test_llm_default_is_the_bundled_model_and_greedy_is_stable():
    from deepinfer import LLM, SamplingParams

    llm = LLM(max_num_seqs=2, max_num_batched_tokens=32)
    assert llm.tokenizer is not None and llm.cfg.vocab_size == 4096
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
    assert list(out.token_ids) == EXPECTED_IDS, (list(out.token_ids), out.text)
    assert out.text == EXPECTED_TEXT
    assert NAME == "deepinfer-tiny-v4"


README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme_example() -> tuple[dict, dict]:
    """The README's example request body (the curl -d payload) and the response it shows."""
    import re

    text = open(README, encoding="utf-8").read()
    body = re.search(r"curl -s localhost:8000/v1/chat/completions .*?-d '(\{.*?\})'", text, re.S)
    answer = re.search(r"```json\n(\{.*?\})\n```", text[body.end():], re.S)
    assert body and answer, "README lost its example request / response"
    return json.loads(body.group(1)), json.loads(answer.group(1))


def test_server_default_answers_the_readme_example(bundled_server):
    """`python -m deepinfer.serve` with no --model serves the bundled model, and the README's
    example request gets exactly the answer the README shows."""
    import httpx

    body, shown = _readme_example()
    srv = bundled_server
    models = httpx.get(srv.base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    got = httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=120).json()
    assert got["model"] == NAME == body["model"]
    assert got["choices"][0]["message"] == shown["choices"][0]["message"]
    assert got["choices"][0]["finish_reason"] == shown["choices"][0]["finish_reason"]
    assert got["usage"] == shown["usage"]


def test_server_reuses_a_shared_system_prompt(bundled_server):
    """The prefix cache on the server: a chat that repeats a long system prompt skips its prefill
    (usage.prompt_tokens_details.cached_tokens, the metrics, /debug/engine) and answers as before;
    another tenant's cache_salt shares nothing; the flag turns it off."""
    import httpx

    from deepinfer.serve.__main__ import parse_args

    srv = bundled_server
    system = ("You are a careful assistant. Answer in one short line, use plain words, and say when you do not "
              "know. Numbers are written in digits. Lists are separated by commas.")

    def ask(question, **extra):
        body = {"model": NAME, "max_tokens": 8, "temperature": 0, **extra,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        got = httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=120).json()
        return got["choices"][0]["message"]["content"], got["usage"]

    first, usage = ask("What is a list?")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["prompt_tokens"] > 40
    again, usage2 = ask("What is a list?")
    assert again == first and usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    _, other = ask("What is a dict?")  # the same system prompt, another question
    assert other["prompt_tokens_details"]["cached_tokens"] >= 32
    salted, usage3 = ask("What is a list?", cache_salt="tenant-2")
    assert salted == first and usage3["prompt_tokens_details"]["cached_tokens"] == 0
    bad = httpx.post(srv.base + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""})
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
    metrics = httpx.get(srv.base + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("deepinfer:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= usage2["prompt_tokens_details"]["cached_tokens"]
    cache = srv.wait_idle()["prefix_cache"]
    assert cache["blocks"] > 0 and sum(cache["pages_cached"].values()) > 0 and cache["hits"] > 0
    assert parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_args([]).enable_prefix_caching is True
