"""A tiny DeepSeek-V4 with random weights and a byte-level tokenizer, for fast tests and benchmarks.

Every V4 layer type at toy widths (configs/tiny_mixed.json), a tokenizer of 256 byte
tokens + DeepSeek's special tokens (no merges, so any text encodes) and DeepSeek's
chat template. Its text is noise, but the same noise on every machine (seed 0), and
the server starts on it in seconds. Built once into a cache folder in Hugging Face
layout; ``DEEPINFER_CACHE`` (or the ``root`` argument) moves it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from deepinfer.default_model import (
    BOS,
    EOS,
    SPECIAL_TOKENS,
    cache_root,
    write_tokenizer_files,
)

NAME = "deepinfer-tiny-random"
VERSION = 2  # bump when what is built changes, so stale caches are rebuilt


def _config() -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "configs", "tiny_mixed.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(vocab_size=260, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257)
    return cfg


def build_tokenizer():
    """Byte-level BPE without merges: ids 0-255 are bytes, 256-259 the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from deepinfer.text.detokenizer import byte_decoder

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=byte_decoder().__getitem__)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def ensure_random_model(root: str | None = None) -> str:
    """The random model's folder under ``root`` (default: cache_root()), built on first use
    (atomically: a half-written one is never seen)."""
    target = os.path.join(root or cache_root(), f"{NAME}-v{VERSION}")
    if os.path.exists(os.path.join(target, "tokenizer_config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(target))
    try:
        _write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not os.path.exists(os.path.join(target, "tokenizer_config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(directory: str) -> None:
    import jax

    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.models.deepseek_v4.loader import save_official
    from deepinfer.params import init_params

    cfg = ModelConfig.from_dict(_config())
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(0), "float32")
    # Initialised weights give logits of std ~0.1: a near-uniform next-token distribution
    # where greedy picks among near-ties. A 40x head makes it peaked (logit std ~4), so
    # greedy output is decided by the model, not by rounding, and samples look like samples.
    params["head"] = params["head"] * 40.0
    save_official(cfg, params, directory)
    tok = build_tokenizer()
    if tok.token_to_id(BOS) != cfg.bos_token_id or tok.token_to_id(EOS) != cfg.eos_token_ids[0]:
        raise AssertionError("special token ids disagree with the config")
    write_tokenizer_files(tok, directory, cfg.max_position_embeddings)
