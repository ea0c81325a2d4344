"""Incremental decoding: prefill + decode equal the whole-sequence forward; chunking; rollback.

Decoder runs the engine's state and paged forward (the one incremental path), so these
check the engine's step too."""

import jax
import numpy as np
import pytest

from deepinfer.models.deepseek_v4 import forward
from deepinfer.runtime.decoder import Decoder, StateLayout
from tests.reference import TINY_CONFIGS, load_case

TOLERANCE = 1e-4  # as for the whole-sequence forward: max|Δ| <= TOLERANCE * max|logit|


def _full_logits(case, seq):
    return np.asarray(jax.jit(forward, static_argnums=0)(case.cfg, case.params, np.asarray([seq])))[0]


def _close(a, b):
    return np.max(np.abs(a - b)) <= TOLERANCE * np.max(np.abs(b))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_prefill_then_decode_equals_full_forward(name):
    """Two sequences at different lengths; prompts and decodes cross the window and many
    compression boundaries, with lengths that are not multiples of the ratios."""
    case = load_case(name)
    cfg = case.cfg
    rng = np.random.default_rng(11)
    total = 3 * cfg.sliding_window + 2 * cfg.hca_compress_ratio + 3  # well past the window and several rows
    seqs = rng.integers(0, cfg.vocab_size, (2, total))
    prompt_lens = np.array([cfg.sliding_window + 5, 2 * cfg.hca_compress_ratio + 1])
    n_decode = total - prompt_lens.max()
    dec = Decoder(cfg, StateLayout(batch=2, max_len=total + 4))
    state = dec.init_state()
    prompts = np.zeros((2, prompt_lens.max()), np.int32)
    for b in range(2):
        prompts[b, : prompt_lens[b]] = seqs[b, : prompt_lens[b]]
    logits, state = dec.prefill(case.params, state, prompts, prompt_lens)
    got = [[np.asarray(logits[b, : prompt_lens[b]])] for b in range(2)]
    for step in range(n_decode):
        toks = np.array([seqs[b, prompt_lens[b] + step] for b in range(2)])
        logits, state = dec.decode_step(case.params, state, toks)
        for b in range(2):
            got[b].append(np.asarray(logits[b])[None])
    assert np.asarray(state.lengths).tolist() == (prompt_lens + n_decode).tolist()
    for b in range(2):
        length = prompt_lens[b] + n_decode
        ours = np.concatenate(got[b])[: length - 1]
        ref = _full_logits(case, seqs[b, :length])[: length - 1]
        assert ours.shape == ref.shape
        assert _close(ours, ref), (b, np.max(np.abs(ours - ref)))


def test_chunked_prefill_matches_one_shot():
    case = load_case("mixed")
    cfg = case.cfg
    seqs = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 70))
    lens = np.array([70, 53])
    layout = StateLayout(batch=2, max_len=80)
    dec = Decoder(cfg, layout)
    ref_logits, ref_state = dec.prefill(case.params, dec.init_state(), seqs, lens)
    ref_logits = np.asarray(ref_logits)
    ref_leaves = [np.asarray(x) for x in jax.tree.leaves(ref_state)]
    for chunk in (1, 3, 7, 64):
        logits, state = dec.prefill(case.params, dec.init_state(), seqs, lens, chunk_size=chunk)
        logits = np.asarray(logits)
        for b in range(2):
            assert _close(logits[b, : lens[b]], ref_logits[b, : lens[b]]), chunk
        leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
        assert len(leaves) == len(ref_leaves)
        for got, want in zip(leaves, ref_leaves):
            if want.dtype.kind in "iu":
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


def _decode_all(dec, params, state, tokens):
    out = []
    for t in tokens:
        logits, state = dec.decode_step(params, state, np.array([t]))
        out.append(np.asarray(logits[0]))
    return np.stack(out), state


@pytest.mark.parametrize("name", ["dense_compression", "mixed"])
def test_rollback_then_decode_equals_direct_decode(name):
    """Decode k tokens, roll back k, decode other tokens == decoding those directly, k = 1..max_backtrack.
    The base length puts the k tokens across CSA and HCA boundaries."""
    case = load_case(name)
    cfg = case.cfg
    layout = StateLayout(batch=1, max_len=96)
    dec = Decoder(cfg, layout)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, (1, 2 * cfg.hca_compress_ratio + 1))
    follow = rng.integers(0, cfg.vocab_size, 16)
    direct_state = dec.prefill(case.params, dec.init_state(), prompt)[1]
    direct, _ = _decode_all(dec, case.params, direct_state, follow)
    for k in range(1, layout.max_backtrack + 1):
        _, state = dec.prefill(case.params, dec.init_state(), prompt)
        wrong = (follow[:k] + 1 + rng.integers(0, cfg.vocab_size - 1, k)) % cfg.vocab_size
        _, state = _decode_all(dec, case.params, state, wrong)
        state = dec.rollback(state, k)
        assert int(state.lengths[0]) == prompt.shape[1]
        again, _ = _decode_all(dec, case.params, state, follow)
        assert _close(again, direct), (k, np.max(np.abs(again - direct)))


def test_repeated_rollbacks_within_the_bound():
    """Speculative decoding pattern: several partial rollbacks, always within max_backtrack."""
    case = load_case("dense_compression")
    dec = Decoder(case.cfg, StateLayout(batch=1, max_len=64, max_backtrack=6))
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, case.cfg.vocab_size, (1, 9))
    follow = rng.integers(0, case.cfg.vocab_size, 12)
    direct, _ = _decode_all(dec, case.params, dec.prefill(case.params, dec.init_state(), prompt)[1], follow)

    _, state = dec.prefill(case.params, dec.init_state(), prompt)
    _, state = _decode_all(dec, case.params, state, np.r_[follow[:2], [0, 1, 2, 3]])  # 2 right, 4 wrong
    state = dec.rollback(state, 4)
    _, state = _decode_all(dec, case.params, state, np.r_[follow[2:5], [7]])  # 3 right, 1 wrong
    state = dec.rollback(state, 1)
    got, _ = _decode_all(dec, case.params, state, follow[5:])
    assert _close(got, direct[5:])


def test_rollback_beyond_the_kept_rows_is_refused():
    case = load_case("dense_compression")
    dec = Decoder(case.cfg, StateLayout(batch=2, max_len=64, max_backtrack=4))
    _, state = dec.prefill(case.params, dec.init_state(), np.ones((2, 10), np.int32))
    with pytest.raises(ValueError, match=r"sequence 0: rolling back to length 5 would go 5 tokens behind .* at most max_backtrack=4"):
        dec.rollback(state, 5)
    with pytest.raises(ValueError, match="cannot roll back"):
        dec.rollback(state, [11, 0])
    state = dec.rollback(state, [4, 1])
    assert np.asarray(state.lengths).tolist() == [6, 9]
    # 2 more on sequence 0 would be 6 behind its furthest position (10)
    with pytest.raises(ValueError, match="sequence 0"):
        dec.rollback(state, [2, 0])
