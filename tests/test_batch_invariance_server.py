"""Batch-invariant mode through the server, with default engine flags (token budget 256, 16 sequences,
every default bucket): a request's logprobs alone and among 8 concurrent requests of mixed lengths
are bitwise equal. The tiny random model (byte tokenizer) keeps the server's warm-up short."""

from __future__ import annotations

import asyncio

import openai
import pytest

from deepinfer.random_model import ensure_random_model
from tests.server_process import ServerProcess

MODEL = "deepinfer-tiny-random"
NEEDLE = "The built-in function sorted returns a new sorted list from the items in iterable."


@pytest.fixture(scope="module")
def server(server_cache, tmp_path_factory):
    # nothing but the model and the mode is set
    srv = ServerProcess(["--model", ensure_random_model(server_cache), "--served-model-name", MODEL, "--batch-invariant"],
                        server_cache, str(tmp_path_factory.mktemp("log") / "server.log"), timeout=600)
    yield srv
    srv.stop()


def needle_request(client, **extra):
    return client.completions.create(model=MODEL, prompt=NEEDLE, max_tokens=12, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True}, **extra)


def logprobs_of(choice):
    lp = choice.logprobs
    return choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs


async def needle_among_others(base: str):
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    # mixed lengths: prompts of 24 to 96 tokens (bytes; the model's limit is 128), outputs of 4 to 25,
    # some sampled: 560 prompt tokens arrive together, so steps fill the 256-token bucket
    others = [
        client.completions.create(model=MODEL, prompt="Lists and dictionaries. " * k, max_tokens=4 + 3 * i,
                                  temperature=[0, 0.8][i % 2], seed=i, extra_body={"ignore_eos": True})
        for i, k in enumerate((1, 4, 2, 3, 1, 4, 2, 3))
    ]
    started = [asyncio.ensure_future(o) for o in others[:4]]
    await asyncio.sleep(0.05)  # the needle arrives while the first ones are prefilling
    needle = asyncio.ensure_future(needle_request(client))
    started += [asyncio.ensure_future(o) for o in others[4:]]
    results = await asyncio.gather(needle, *started)
    await client.close()
    return results[0]


def test_logprobs_alone_and_among_concurrent_requests_are_bitwise_equal(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)
    alone = logprobs_of(needle_request(client).choices[0])
    for _ in range(2):
        batched = logprobs_of(asyncio.run(needle_among_others(server.base)).choices[0])
        assert batched == alone  # floats compared exactly: same bits
    assert len(alone[2]) == 12 and all(lp is not None for lp in alone[2])
