"""A prefix cache saved with orbax serves hits in a freshly started engine exactly as in the engine
that computed it, and is refused, naming the difference, by an engine it does not fit."""

import json

import jax
import numpy as np
import pytest

from deepinfer.params import init_params
from deepinfer.runtime.prefix_persistence import (
    HOST_FILE,
    load_prefix_cache,
    save_prefix_cache,
)
from deepinfer.scheduler.sampling_params import SamplingParams
from tests.prefix_cases import base_prompt, engine, run_each, sharing
from tests.reference import load_case

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def case():
    c = load_case("mixed")
    return c.cfg, c.params, c.cfg.vocab_size


@pytest.fixture(scope="module")
def saved(case, tmp_path_factory):
    """An engine that served a 90-token prompt (plain and salted), then a second prompt hitting it;
    its cache saved before that second prompt."""
    cfg, params, vocab = case
    a = base_prompt(vocab)
    first = engine(cfg, params)
    run_each(first, [a, a], GREEDY, salts=[None, "tenant-1"])
    path = tmp_path_factory.mktemp("prefix") / "cache"
    summary = save_prefix_cache(first, path)
    (continued,) = run_each(first, [sharing(a, 70, vocab)], GREEDY)  # the engine that never restarted
    return path, summary, continued


def test_a_restarted_engine_hits_the_saved_cache_exactly(case, saved):
    cfg, params, vocab = case
    path, summary, continued = saved
    assert summary["blocks"] >= 10 and summary["snapshots"] >= 2
    restarted = engine(cfg, params)
    assert load_prefix_cache(restarted, path) == summary
    restarted.check_all_free()  # every restored page held by exactly its blocks
    (rb,) = run_each(restarted, [sharing(base_prompt(vocab), 70, vocab)], GREEDY)
    assert rb.num_cached_tokens == continued.num_cached_tokens == 64
    assert rb.output_token_ids == continued.output_token_ids
    for x, y in zip(rb.logits, continued.logits):
        np.testing.assert_array_equal(x, y)  # the same rows and snapshots: the same bits
    (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [sharing(base_prompt(vocab), 70, vocab)], GREEDY)
    assert rb.output_token_ids == off.output_token_ids


def test_salted_blocks_stay_salted_after_a_restart(case, saved):
    cfg, params, vocab = case
    restarted = engine(cfg, params)
    load_prefix_cache(restarted, saved[0])
    a = base_prompt(vocab)
    other, mine = run_each(restarted, [sharing(a, 60, vocab), sharing(a, 60, vocab)], GREEDY, salts=["tenant-2", "tenant-1"])
    assert other.num_cached_tokens == 0 and mine.num_cached_tokens > 0


def test_a_cache_that_does_not_fit_is_refused_naming_why(case, saved, tmp_path):
    cfg, params, _ = case
    path = saved[0]
    other_weights = init_params(_spec(cfg), jax.random.key(7))
    with pytest.raises(ValueError, match=r"was saved with other model weights"):
        load_prefix_cache(engine(cfg, other_weights), path)
    with pytest.raises(ValueError, match=r"does not fit this engine: num_snapshots was 16, is 3"):
        load_prefix_cache(engine(cfg, params, prefix_snapshots=3), path)
    with pytest.raises(ValueError, match=r"does not fit this engine: page_size was 4, is 8"):
        load_prefix_cache(engine(cfg, params, page_size=8), path)
    host = json.loads((path / HOST_FILE).read_text())
    host["blocks"][3]["tokens"][0] ^= 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / HOST_FILE).write_text(json.dumps(host))
    with pytest.raises(ValueError, match=r"saved prefix cache block 3 does not match its tokens"):
        load_prefix_cache(engine(cfg, params), _with_arrays(path, broken))


def test_save_and_load_need_an_idle_engine(case, saved, tmp_path):
    cfg, params, vocab = case
    eng = engine(cfg, params)
    eng.add_request(base_prompt(vocab, 20), GREEDY)
    with pytest.raises(RuntimeError, match=r"only be saved or loaded while the engine is idle"):
        save_prefix_cache(eng, tmp_path / "x")
    eng.run_until_done()
    with pytest.raises(RuntimeError, match=r"loads only into an empty one"):
        load_prefix_cache(eng, saved[0])
    with pytest.raises(ValueError, match=r"prefix caching is off"):
        save_prefix_cache(engine(cfg, params, enable_prefix_caching=False), tmp_path / "y")


def _spec(cfg):
    from deepinfer.models.deepseek_v4 import model_spec

    return model_spec(cfg, include_mtp=False)


def _with_arrays(saved_path, host_dir):
    """host_dir's JSON beside a copy of saved_path's arrays."""
    import shutil

    shutil.copytree(saved_path / "arrays", host_dir / "arrays")
    return host_dir


@pytest.mark.slow
def test_server_keeps_its_prefix_cache_across_a_restart(tmp_path):
    """python -m deepinfer.serve --prefix-cache-dir: saved on a graceful shutdown, loaded at start-up,
    the restarted server's first request hits it (two server start-ups: `pytest -m slow`)."""
    import httpx

    from tests.server_process import ServerProcess

    body = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 3, "max_tokens": 4,
            "temperature": 0}
    args = ["--served-model-name", "m", "--prefix-cache-dir", str(tmp_path / "pc"), "--max-num-seqs", "2",
            "--max-model-len", "128"]
    answers = []
    for run in range(2):
        server = ServerProcess(args, str(tmp_path / "jax"), str(tmp_path / f"server{run}.log"))
        try:
            r = httpx.post(server.base + "/v1/completions", json=body, timeout=60).json()
            answers.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        finally:
            server.stop()  # SIGTERM: a graceful shutdown (uvicorn re-raises the signal at the end)
        assert "prefix cache: saved" in server.log()
    assert "prefix cache: loaded" in server.log()
    assert answers[0][1] == 0 and answers[1][1] > 0
    assert answers[0][0] == answers[1][0]


def test_a_data_parallel_cache_is_saved_per_rank_and_hits_on_its_rank_after_a_restart(tmp_path):
    """DP2 on 2 fake devices (tests/prefix_persistence_dp_run.py, a subprocess): each rank's blocks are
    saved and loaded back onto that rank, so a restarted engine places and hits a prompt as the engine
    that never restarted does, with the same tokens; a one-rank engine refuses the file by name."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: the child keeps its level
    done = subprocess.run([sys.executable, "-m", "tests.prefix_persistence_dp_run", str(tmp_path / "cache")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))
    assert sorted(x["rank"] for x in r["cold"]) == [0, 1] and all(x["cached"] == 0 for x in r["cold"])
    assert r["loaded"] == r["summary"] and r["summary"]["blocks"] >= 8
    # the restarted engine places each prompt on the rank holding its prefix and hits it as far
    assert [x["rank"] for x in r["after"]] == [x["rank"] for x in r["continued"]] == [x["rank"] for x in r["cold"]]
    assert [x["cached"] for x in r["after"]] == [x["cached"] for x in r["continued"]]
    assert all(x["cached"] >= 48 for x in r["after"])  # (70 and 60 tokens shared)
    assert [x["tokens"] for x in r["after"]] == [x["tokens"] for x in r["continued"]]
    assert "data_parallel_size was 2, is 1" in r["refusal"]
