"""The jitted generate(): greedy equals transformers, seeded sampling, EOS and per-sequence limits."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import deepinfer
from deepinfer.runtime.sampler import filter_logits, sample
from tests.reference import load_case

PROMPTS = [[5, 17, 42, 8, 77, 3, 60, 11, 29, 90], [1, 2, 3], [9, 4] * 11]


@pytest.mark.parametrize("name", ["mixed", "dense_compression"])
def test_greedy_generate_equals_transformers(name):
    """Several prompts of different lengths in one batch, 40 new tokens each."""
    case = load_case(name)
    prompts = [[t % case.cfg.vocab_size for t in p] for p in PROMPTS]
    out = deepinfer.generate(case.cfg, case.params, prompts, max_new_tokens=40, eos_token_ids=())
    assert np.asarray(out.num_generated).tolist() == [40, 40, 40]
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = case.model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert np.asarray(out.tokens[i]).tolist() == ref[0, len(p):].tolist(), i


def test_same_seed_same_tokens_different_seed_different_tokens():
    case = load_case("mixed")
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, eos_token_ids=())
    a = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, seeds=[1, 2, 3], **kw).tokens)
    b = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, seeds=[1, 2, 3], **kw).tokens)
    c = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, seeds=[4, 5, 6], **kw).tokens)
    np.testing.assert_array_equal(a, b)
    assert all((a[i] != c[i]).any() for i in range(3))
    greedy = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, max_new_tokens=24, eos_token_ids=()).tokens)
    assert (a != greedy).any()  # sampling really sampled


def test_sampling_noise_does_not_depend_on_the_batch_slot():
    """Same logits, seed and position in different slots sample the same token."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 50)), jnp.float32).repeat(6, axis=0)
    seeds = jnp.asarray([3, 8, 3, 8, 3, 3])
    pos = jnp.asarray([10, 10, 10, 10, 10, 11])
    toks = np.asarray(sample(logits, pos, seeds, jnp.ones(6), jnp.zeros(6, jnp.int32), jnp.ones(6)))
    assert toks[0] == toks[2] == toks[4] and toks[1] == toks[3]
    assert len(set(toks.tolist())) > 1  # seeds and positions do change the draw


def test_reordering_the_batch_does_not_change_a_sequences_samples():
    case = load_case("mixed")
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, eos_token_ids=())
    fwd = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, seeds=[1, 2, 3], **kw).tokens)
    rev = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS[::-1], seeds=[3, 2, 1], **kw).tokens)
    np.testing.assert_array_equal(fwd, rev[::-1])


def test_eos_and_per_sequence_max_tokens():
    case = load_case("mixed")
    greedy = np.asarray(deepinfer.generate(case.cfg, case.params, PROMPTS, max_new_tokens=24, eos_token_ids=()).tokens)
    eos = int(greedy[0, 4])
    first_eos = [int(np.argmax(row == eos)) if (row == eos).any() else None for row in greedy]
    out = deepinfer.generate(case.cfg, case.params, PROMPTS, max_new_tokens=24, max_tokens=[24, 3, 24], eos_token_ids=[eos])
    tokens = np.asarray(out.tokens)
    n = first_eos[0] + 1
    assert tokens[0, :n].tolist() == greedy[0, :n].tolist() and (tokens[0, n:] == -1).all()
    assert bool(out.stopped_on_eos[0]) and int(out.num_generated[0]) == n
    limit1 = 3 if first_eos[1] is None or first_eos[1] >= 3 else first_eos[1] + 1
    assert int(out.num_generated[1]) == limit1 and (tokens[1, limit1:] == -1).all()


def test_bad_arguments_are_clear_errors():
    case = load_case("mixed")
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 96\)"):
        deepinfer.generate(case.cfg, case.params, [[1, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        deepinfer.generate(case.cfg, case.params, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"temperature must be a scalar or have one value per sequence \(2\)"):
        deepinfer.generate(case.cfg, case.params, [[1], [2]], max_new_tokens=2, temperature=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"max_tokens must lie in \[1, max_new_tokens=2\]"):
        deepinfer.generate(case.cfg, case.params, [[1]], max_new_tokens=2, max_tokens=5)


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    out = np.asarray(filter_logits(logits, jnp.ones(4), jnp.asarray([0, 2, 0, 1]), jnp.asarray([1.0, 1.0, 0.6, 0.9])))
    kept = np.isfinite(out)
    assert kept[0].tolist() == [True] * 5  # no filter
    assert kept[1].tolist() == [True, True, False, False, False]  # top-2
    assert kept[2].tolist() == [True, True, False, False, False]  # 0.5 < 0.6 -> 0.5 + 0.2 reaches it
    assert kept[3].tolist() == [True, False, False, False, False]  # top-1 wins over top-p


def test_sampled_frequencies_follow_the_distribution():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    n = 4000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 4))
    toks = np.asarray(sample(logits, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n)))
    freq = np.bincount(toks, minlength=4) / n
    assert np.all(np.abs(freq - probs) < 4 * np.sqrt(probs * (1 - probs) / n)), freq
