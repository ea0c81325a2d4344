"""The bundled model's training code (scripts/tiny_model): deterministic, learning, balanced, splitting data soundly."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("optax")

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.params import flatten_dotted  # noqa: E402
from scripts.tiny_model import data  # noqa: E402
from scripts.tiny_model.model_config import model_config  # noqa: E402
from scripts.tiny_model.train import train  # noqa: E402

SEQ = 32


def _tiny_cfg() -> ModelConfig:
    cfg = model_config(vocab_size=64, hidden=32, moe_intermediate=16, max_len=256)
    cfg.update(q_lora_rank=16, o_lora_rank=8, head_dim=16, index_head_dim=8, index_topk=4, sliding_window=8)
    return ModelConfig.from_dict(cfg)


def _stream(n: int, seed: int) -> np.ndarray:
    """A learnable stream: a repeating 8-token pattern with a few random tokens mixed in."""
    rng = np.random.default_rng(seed)
    s = np.tile(np.arange(4, 12, dtype=np.int32), n // 8 + 1)[:n]
    noise = rng.random(n) < 0.1
    s[noise] = rng.integers(12, 64, noise.sum())
    return s


def _run(steps: int, seed: int = 0):
    val = data.pack(_stream(SEQ * 8 + 8, 99), SEQ + 1)
    return train(_tiny_cfg(), _stream(4096, 1), val, seed=seed, steps=steps, batch=4, seq_len=SEQ, peak_lr=3e-3,
                 warmup=2, weight_decay=0.1, eval_every=steps, eval_batch=4, log=lambda s: None)


@pytest.mark.slow  # 23 s; trains, serves nothing (suite time)
def test_training_is_deterministic_and_learns():
    params_a, hist_a = _run(30)
    params_b, hist_b = _run(30)
    flat_a, flat_b = flatten_dotted(params_a), flatten_dotted(params_b)
    for k in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k]), err_msg=k)
    assert [h["train_loss"] for h in hist_a] == [h["train_loss"] for h in hist_b]
    # a pattern this regular is learned within 30 steps, for the next token and (MTP) the one after
    assert hist_a[0]["train_loss"] > 3.5 and hist_a[-1]["val_loss"] < 2.6, hist_a  # ln(64) = 4.16 at the start
    assert hist_a[-1]["val_mtp_loss"] < 3.0 and hist_a[-1]["mtp_agreement"] > 0.5, hist_a[-1]
    # the score-routed layers' selection biases moved (loss-free balancing); hash tables did not
    assert np.abs(np.asarray(flat_a["layers.1.ffn.gate.bias"])).max() > 0
    other, _ = _run(3, seed=1)
    assert not np.array_equal(np.asarray(flatten_dotted(other)["embed"]), np.asarray(flat_a["embed"]))


def test_validation_split_is_fixed_and_disjoint():
    docs = [(src, "text", f"{src} document {i}") for src in ("a", "b") for i in range(400)]
    train_docs, val_docs = data.split(docs)
    assert 0 < len(val_docs) < 0.08 * len(docs)
    assert not {d[2] for d in train_docs} & {d[2] for d in val_docs}
    assert data.split(docs) == (train_docs, val_docs)


def test_epoch_rows_are_a_seeded_permutation():
    stream = np.arange(1000, dtype=np.int32)
    a, b = data.shuffled_rows(stream, 33, 0, 7), data.shuffled_rows(stream, 33, 0, 7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, data.shuffled_rows(stream, 33, 1, 7))
    assert (np.diff(a, axis=1) == 1).all()  # rows are contiguous slices of the stream
