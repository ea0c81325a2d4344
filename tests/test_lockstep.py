"""runtime/lockstep.py in one process: a leader engine records its turns into a key-value store
shaped like JAX's coordination service; a second engine replays them afterwards (no collectives
here, so it need not run beside the leader) and must do exactly what the leader did: the same
steps, the same tokens, the same speculation plans (confidence scheduling plans from step times,
which the follower takes from the leader, not from its own clock), the same aborts."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from deepinfer.default_model import default_model_dir
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.lockstep import LeaderEngine, follow
from deepinfer.runtime.turn_channel import TurnChannel
from deepinfer.scheduler.buckets import rows_for
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.step_cost import StepCostModel


class FakeStore:
    """The three calls of JAX's DistributedRuntimeClient the channel uses."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}
        self.sets = 0

    def key_value_set_bytes(self, key, value):
        self.kv[key] = value
        self.sets += 1

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.kv:
            raise RuntimeError("DEADLINE_EXCEEDED: nothing under " + key)
        return self.kv[key]

    def key_value_delete(self, key):  # the key and everything under it as a directory
        for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
            del self.kv[k]


CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=192, token_buckets=(8, 32),
                      context_buckets=(), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                      mtp_varlen=True)


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(default_model_dir(), mtp="require")


def test_a_follower_replays_the_leaders_turns_exactly(model):
    cfg, params = model
    store = FakeStore()
    engine = LLMEngine(cfg, params, CONFIG)
    # confidence scheduling plans from a step-cost model (warm-up timings, then the loop's step times).
    # Here the warm-up's figures make drafting free, so that the leader surely drafts at first (timings
    # on a busy machine can price drafts out from the start); its own step times then refine them
    flat = {}
    for t in engine.token_buckets:
        r = rows_for(t, engine.row_buckets)
        flat.update({(t, r, "depth", d): 1e-3 for d in range(3)} | {(t, r, "width", w): 0.0 for w in (2, 3)})
    engine.scheduler.step_cost = StepCostModel(flat, engine.token_buckets, engine.row_buckets)
    leader = LeaderEngine(engine, TurnChannel(store, 0, 2))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 40, 11, 23, 9)]
    sps = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
           SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),  # aborted after a few steps
           SamplingParams(max_tokens=12, temperature=0.0, logprobs=1),
           SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)]  # arrives mid-run, no seed of its own
    reqs = [leader.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts[:4], sps))]
    calls = 0
    for step in range(40):
        if not leader.has_unfinished:
            break
        leader.step()
        calls += 1
        if step == 3:
            leader.abort(reqs[2])
            reqs.append(leader.add_request(prompts[4], sps[4], request_id="r4", priority=0))
    leader.close()  # (no follower confirms the stop here: the leader logs it and goes on)
    engine.check_all_free()

    replica = LLMEngine(cfg, params, CONFIG)
    replica.scheduler.step_cost = StepCostModel({}, replica.token_buckets, replica.row_buckets)  # replaced
    seen = {}
    add = replica.add_request

    def add_and_keep(*a, **kw):
        req = add(*a, **kw)
        seen[req.request_id] = req
        return req

    replica.add_request = add_and_keep
    steps = follow(replica, TurnChannel(store, 1, 2))
    replica.check_all_free()
    assert steps == calls and replica.num_steps == engine.num_steps > 10
    assert [seen[r.request_id].output_token_ids for r in reqs] == [r.output_token_ids for r in reqs]
    assert [seen[r.request_id].finish_reason for r in reqs] == [r.finish_reason for r in reqs]
    assert reqs[2].finish_reason == "abort" and len(reqs[2].output_token_ids) < 30
    a, b = engine.stats(), replica.stats()
    assert a.num_draft_tokens > 0 and (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (
        b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens)
    # every turn read was deleted (the store does not grow with the steps); the follower confirmed the stop
    assert list(store.kv) == ["deepinfer/stopped/1"] and store.sets == steps + 2


def test_a_follower_started_with_other_settings_is_refused_by_name(model):
    cfg, params = model
    store = FakeStore()
    LeaderEngine(LLMEngine(cfg, params, CONFIG), TurnChannel(store, 0, 2)).close()
    other = LLMEngine(cfg, params, dataclasses.replace(CONFIG, max_num_seqs=2))
    with pytest.raises(RuntimeError, match="this process's engine differs from rank 0's.*max_num_seqs=2"):
        follow(other, TurnChannel(store, 1, 2))
    jax.clear_caches()
