"""Decode throughput of the jitted on-device generate(), and transformers' generate() beside it.

    python benchmarks/generate_throughput.py [--new-tokens 64] [--prompt-len 32] [--batches 1,8,32]

For each config (configs/tiny_mixed.json and configs/mid.json, random weights) and
batch size, the decode rate is measured as batch * (N - 1) / (T(N) - T(1)), where
T(n) is the wall time of a compiled generate() call making n tokens per sequence
(so prefill and the first token cancel out). transformers runs greedy generate()
on the same tiny checkpoint (same weights, loaded by both) in the same process,
measured the same way; the ratio is printed. Prints a table and one JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import deepinfer  # noqa: E402
from benchmarks.timing import best_time  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.params import count_params, init_params  # noqa: E402


def deepinfer_rate(cfg, params, batch, prompt_len, new_tokens) -> float:
    prompts = np.random.default_rng(batch).integers(2, cfg.vocab_size, (batch, prompt_len))

    def run(n):
        out = deepinfer.generate(cfg, params, prompts, max_new_tokens=n, eos_token_ids=())
        jax.block_until_ready(out.tokens)

    run(new_tokens), run(1)  # compile both programs
    t_n, t_1 = best_time(lambda: run(new_tokens)), best_time(lambda: run(1))
    return batch * (new_tokens - 1) / max(t_n - t_1, 1e-9)


def transformers_rate(model, vocab, batch, prompt_len, new_tokens) -> float:
    import torch

    prompts = torch.as_tensor(np.random.default_rng(batch).integers(2, vocab, (batch, prompt_len)))

    def run(n):
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    run(2)
    t_n, t_1 = best_time(lambda: run(new_tokens), 2), best_time(lambda: run(1), 2)
    return batch * (new_tokens - 1) / max(t_n - t_1, 1e-9)


def tiny_checkpoint(directory: str):
    """A transformers model with random weights saved to `directory`; returns the torch model."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = json.load(open(os.path.join(ROOT, "configs", "tiny_mixed.json")))
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**raw, attn_implementation="eager")).eval()
    with torch.no_grad():  # the default init leaves tid2eid at zero: give hash layers real tables
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                rows = torch.rand(layer.mlp.gate.tid2eid.shape[0], raw["n_routed_experts"]).argsort(-1)
                layer.mlp.gate.tid2eid.copy_(rows[:, : raw["num_experts_per_tok"]])
    model.save_pretrained(directory)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-mid", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    record = {"device": jax.devices()[0].device_kind, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "results": []}

    with tempfile.TemporaryDirectory() as d:
        torch_model = tiny_checkpoint(d)
        tiny_cfg, tiny_params = load_checkpoint(d)
    setups = [("tiny", tiny_cfg, tiny_params)]
    if not args.skip_mid:
        mid_cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", "mid.json"))
        setups.append(("mid", mid_cfg, init_params(model_spec(mid_cfg, include_mtp=False), jax.random.key(0))))

    print(f"{'model':6} {'params':>12} {'batch':>5} {'deepinfer tok/s':>16} {'transformers tok/s':>19} {'ratio':>7}")
    for name, cfg, params in setups:
        n_params = count_params(model_spec(cfg, include_mtp=False))
        for b in batches:
            ours = deepinfer_rate(cfg, params, b, args.prompt_len, args.new_tokens)
            ref = transformers_rate(torch_model, cfg.vocab_size, b, args.prompt_len, args.new_tokens) if name == "tiny" else None
            row = {"model": name, "params": n_params, "batch": b, "deepinfer_tok_s": round(ours, 1)}
            if ref is not None:
                row.update(transformers_tok_s=round(ref, 1), ratio=round(ours / ref, 2))
            record["results"].append(row)
            ref_s = f"{ref:19.1f} {ours / ref:7.2f}" if ref is not None else f"{'-':>19} {'-':>7}"
            print(f"{name:6} {n_params:12,} {b:5d} {ours:16.1f} {ref_s}", flush=True)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
