"""The training report: loss.png and TRAINING.md, from training_log.json and the corpus manifest.

Re-runnable on its own (``python -m scripts.tiny_model.report DIR``) so the report
can be redrawn without retraining.
"""

from __future__ import annotations

import json
import math
import os
import sys


def plot_losses(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [h["tokens"] / 1e6 for h in history]
    evals = [h for h in history if "val_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tokens, [h["train_loss"] for h in history], label="train (next token)", lw=1)
    ax.plot(tokens, [h["train_mtp_loss"] for h in history], label="train (MTP, token t+2)", lw=1, alpha=0.7)
    ax.plot([h["tokens"] / 1e6 for h in evals], [h["val_loss"] for h in evals], "o-", label="validation (next token)")
    ax.plot([h["tokens"] / 1e6 for h in evals], [h["val_mtp_loss"] for h in evals], "s--", label="validation (MTP)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(bottom=min(h["train_loss"] for h in history) - 0.3, top=min(9.0, history[0]["train_mtp_loss"] + 0.3))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("deepinfer-tiny-v4 training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(directory: str, summary: dict, history: list[dict], manifest: dict) -> None:
    plot_losses(history, os.path.join(directory, "loss.png"))
    v = summary["final_validation"]
    hp = summary["hyperparameters"]
    src_rows = "\n".join(
        f"| {src} | {manifest['documents'][src]} | {manifest['characters'][src]:,} |" for src in manifest["documents"]
    )
    mix = ", ".join(f"{k} {v:g}" for k, v in manifest["train_mix"].items()) + ", others 1"
    text = f"""# deepinfer-tiny-v4: training report

Written by `python -m scripts.tiny_model` (scripts/tiny_model/); figures below are from
`training_log.json` in this folder.

![loss](loss.png)

| | |
|---|---|
| parameters | {summary['parameters']:,} ({summary['parameters_without_mtp']:,} without the MTP block) |
| training wall time | {summary['train_wall_s'] / 60:.1f} min ({summary['machine']['cpus']} CPU cores, jax {summary['machine']['jax']}) |
| steps x batch x length | {hp['steps']} x {hp['batch']} x {hp['seq_len']} = {hp['steps'] * hp['batch'] * hp['seq_len']:,} tokens |
| final validation loss | {v['val_loss']:.4f} nats/token (perplexity {v['val_ppl']:.2f}) on {v['val_tokens']:,} tokens |
| validation next-token top-1 | {v['val_top1']:.3f} |
| MTP validation loss (token t+2) | {v['val_mtp_loss']:.4f} (perplexity {math.exp(v['val_mtp_loss']):.2f}) |
| MTP top-1 == true token t+2 | {v['mtp_top1']:.3f} |
| MTP top-1 == main model's top-1 at t+1 | {v['mtp_agreement']:.3f} |

The validation figures are computed on the saved weights (bf16 matrices, fp32 norms /
hyper-connection / sink / bias tensors), read back with deepinfer's loader. "MTP
agreement" is what greedy speculative decoding's acceptance of the first draft token
depends on: the MTP block's top-1 for t+2 (given the true t+1) against the main model's
own top-1 when it is run one position further.

## Training set-up
- Loss: next-token cross-entropy + 0.3 x the MTP block's cross-entropy for token t+2.
- AdamW (b1 0.9, b2 0.95, weight decay {hp['weight_decay']} on matrices only), peak learning rate
  {hp['lr']}, {hp['warmup']} warm-up steps then cosine decay to 10%, gradient clipping at 1.0, fp32.
- Expert balance without an auxiliary loss: each score-routed layer's selection bias moves by
  1e-3 x sign(mean load - expert load) after every step. The first layer routes by a fixed
  random token -> experts table (hash MoE).
- Seed {hp['seed']}; data order from numpy's seeded generator, so a rerun on the same corpus
  gives the same weights.

## Corpus
{manifest['train_tokens']:,} training tokens per epoch (copies per document by source: {mix}),
{manifest['validation_tokens']:,} validation tokens; {manifest['validation_documents']} of
{manifest['validation_documents'] + manifest['train_documents']} documents held out (a fixed ~3% by hash).

| source | documents | characters |
|---|---|---|
{src_rows}

Versions: Python {manifest['python']} (pydoc_data.topics and the standard library's
docstrings, read from source with `ast`), numpy {manifest['numpy']} (docstrings, same way),
chatterbot-corpus {manifest['chatterbot-corpus']} (English dialogues), generated snippets
(JSON objects, key/value lists, arithmetic / capitals / word / list Q&A) with seed
{manifest['snippets_seed']}. Tokenizer: byte-level BPE, {manifest['vocab_size']} tokens, trained on the
training split with the `tokenizers` library.
"""
    qa_path = os.path.join(directory, "qa_eval.json")
    if os.path.exists(qa_path):  # written by `python -m scripts.tiny_model.qa_eval DIR > DIR/qa_eval.json`
        with open(qa_path, encoding="utf-8") as f:
            qa = json.load(f)
        ex = qa["examples"][0]
        text += f"""
## What it can and cannot do
Held-out generated Q&A (`python -m scripts.tiny_model.qa_eval`, greedy through the engine):
{qa['exact']} of {qa['questions']} answers exactly right. The model has learned the shapes (a JSON
object with the right keys, "X plus Y is Z.", "The capital of ... is ...") but not to copy values
from the question or to compute: asked `{ex['question']!r}` it answers `{ex['answer']!r}`.
Python-documentation prose comes out fluent-looking and mostly meaningless. It is a demo and test
model (every V4 code path with real, non-random weights; an MTP head that agrees with the model),
not an assistant.
"""
    with open(os.path.join(directory, "TRAINING.md"), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    d = sys.argv[1]
    with open(os.path.join(d, "training_log.json"), encoding="utf-8") as f:
        log = json.load(f)
    with open(os.path.join(d, "corpus_manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    write_report(d, log["summary"], log["history"], manifest)
