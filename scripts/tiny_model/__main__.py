"""Build the bundled default model from nothing: corpus -> tokenizer -> training -> checkpoint + report.

    pip install -e '.[train]'
    python -m scripts.tiny_model --out deepinfer/assets/deepinfer-tiny-v4

Writes a Hugging Face style folder (config.json, model.safetensors with the MTP block,
tokenizer.json, tokenizer_config.json), plus training_log.json, corpus_manifest.json,
loss.png and TRAINING.md (the report). The defaults are what the committed model was
trained with (~45 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.models.deepseek_v4.loader import load_checkpoint, save_official
from deepinfer.params import FLOAT32, count_params, flatten_dotted, unflatten_dotted
from deepinfer.text.tokenizer import TextTokenizer
from scripts.tiny_model import data
from scripts.tiny_model.corpus import build_corpus
from scripts.tiny_model.model_config import model_config
from scripts.tiny_model.report import write_report
from scripts.tiny_model.train import evaluate, make_eval_step, split_trainable, train


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=96, help="validation rows for the periodic evaluations")
    p.add_argument("--max-len", type=int, default=4096, help="max_position_embeddings written to config.json")
    return p.parse_args()


def storage_dtypes(cfg: ModelConfig, params: dict) -> dict:
    """bf16 for the model-dtype weights; fp32 kept where the reference keeps fp32 (norms, hc, sinks, biases)."""
    specs = flatten_dotted(model_spec(cfg, include_mtp=True))
    flat = flatten_dotted(params)
    out = {}
    for path, value in flat.items():
        spec = specs[path]
        keep = spec.dtype == FLOAT32 or not jnp.issubdtype(value.dtype, jnp.floating)
        out[path] = np.asarray(value if keep else value.astype(jnp.bfloat16))
    return unflatten_dotted(params, out)


def main() -> None:
    args = _parse()
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    docs, manifest = build_corpus(args.seed)
    train_docs, val_docs = data.split(docs)
    tok = data.train_tokenizer(train_docs, args.vocab)
    data.save_tokenizer(tok, args.out, args.max_len)
    text_tok = TextTokenizer.from_dir(args.out)
    train_stream = data.encode_docs(text_tok, train_docs, data.TRAIN_MIX)
    val_rows = data.pack(data.encode_docs(text_tok, val_docs), args.seq_len + 1)
    manifest.update(
        train_documents=len(train_docs), validation_documents=len(val_docs), train_tokens=int(len(train_stream)),
        validation_tokens=int(val_rows.size), train_mix=data.TRAIN_MIX, vocab_size=tok.get_vocab_size(),
    )
    print(json.dumps(manifest, indent=1), flush=True)

    cfg_dict = model_config(tok.get_vocab_size(), max_len=args.max_len)
    cfg = ModelConfig.from_dict(cfg_dict)
    hp = {k: getattr(args, k) for k in ("seed", "steps", "batch", "seq_len", "lr", "warmup", "weight_decay")}
    t_train = time.perf_counter()
    # periodic evaluations on rows spread over the whole split (it is ordered by source)
    probe_rows = val_rows[np.linspace(0, len(val_rows) - 1, min(args.eval_rows, len(val_rows))).astype(int)]
    params, history = train(
        cfg, train_stream, probe_rows, seed=args.seed, steps=args.steps, batch=args.batch,
        seq_len=args.seq_len, peak_lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        eval_every=args.eval_every, eval_batch=8, log=lambda s: print(s, flush=True),
    )
    train_wall = time.perf_counter() - t_train

    save_official(cfg, storage_dtypes(cfg, params), args.out)
    # transformers' spelling of config.json (layer_types, compress_rates): its official-spelling
    # parser only knows V4's ratios 4 and 128, and this model's HCA ratio is 16.
    with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    # The report's figures come from the saved (bf16) weights, read back the way the engine reads them.
    cfg_loaded, loaded = load_checkpoint(args.out, mtp="require")
    tr, fx = split_trainable(loaded)
    final = evaluate(make_eval_step(cfg_loaded, jax.tree.map(lambda x: 0, loaded)), tr, fx, val_rows, 8)
    summary = {
        "final_validation": final,
        "train_wall_s": train_wall,
        "total_wall_s": time.perf_counter() - t_start,
        "parameters": count_params(model_spec(cfg, include_mtp=True)),
        "parameters_without_mtp": count_params(model_spec(cfg, include_mtp=False)),
        "hyperparameters": hp,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "jax": jax.__version__},
    }
    with open(os.path.join(args.out, "training_log.json"), "w", encoding="utf-8") as f:
        json.dump({"summary": summary, "history": history}, f, indent=1)
    with open(os.path.join(args.out, "corpus_manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    write_report(args.out, summary, history, manifest)
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
