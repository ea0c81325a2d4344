"""The needle test, run as its own process (the mode needs an XLA flag before JAX starts):

    DEEPINFER_BATCH_INVARIANT=1 python -m tests.needle_batch_invariance \
        --models bundled,random:3 --budgets 13,32,256,2048 --trials 6 --modes on,off

    # on a mesh of fake CPU devices
    XLA_FLAGS=--xla_force_host_platform_device_count=2 DEEPINFER_BATCH_INVARIANT=1 python -m \
        tests.needle_batch_invariance --models bundled --layout '{"tensor_parallel_size": 2}'

A fixed prompt ("the needle", 150 tokens: several prefill chunks at small budgets,
every compression boundary of the bundled model) runs alone, then inside random
batches: 1-7 other prompts of 1-600 tokens arriving at random steps, so steps mix
prefill chunks with decodes and fill the large token buckets. Each engine runs
with the token budget given and its default buckets (--budgets); 2048 compiles a
reduced set of token buckets (16, 256, 2048) to bound compile time. Other prompts
are at most 8 x the budget long (a small budget still chunks them many times). For greedy
and seeded sampling the needle's tokens and log-probabilities (sampled + top-5)
must be bitwise those of its alone run on the same engine.

Models: ``bundled`` is deepinfer-tiny-v4; ``random:K`` draws K configurations from
a seeded generator (layer mix and count, widths, heads, window, compression
ratios, indexer, vocabulary, experts, hc streams) with random weights. Prints one
JSON line: per mode, per model, per budget, how many trials differed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import jax
import numpy as np

import deepinfer  # noqa: F401, I001  (first: configures XLA for the mode)
from deepinfer import SamplingParams
from deepinfer.config import CSA, HASH_MOE, HCA, SCORE_MOE, SLIDING, ModelConfig
from deepinfer.default_model import default_model_dir
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.params import init_params
from deepinfer.runtime.engine import LLMEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDLE_LEN, MAX_OTHER_PROMPT, MAX_MODEL_LEN = 150, 600, 640
NEEDLE_PARAMS = {
    "greedy": dict(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=77, max_tokens=10, logprobs=5, ignore_eos=True),
}
# 2048 with every power of two would compile 16 programs per model and mode; these share
# the 16- and 256-token programs of the budget-256 engine (same layout: the jit cache hits)
TOKEN_BUCKETS = {2048: (16, 256, 2048)}


def draw_config(rng: np.random.Generator) -> ModelConfig:
    """A random small V4 configuration (every field the step's shapes depend on varies)."""
    base = ModelConfig.from_json_file(os.path.join(ROOT, "configs", "tiny_mixed.json"))
    n_layers = int(rng.integers(2, 5))
    layer_types = tuple(rng.choice([SLIDING, CSA, HCA], n_layers).tolist())
    n_hash = int(rng.integers(0, n_layers))
    heads = int(rng.choice([2, 4, 8]))
    head_dim = int(rng.choice([16, 32]))
    experts = int(rng.choice([4, 6, 8, 16]))
    return base.replace(
        vocab_size=int(rng.choice([96, 300, 1000])),
        hidden_size=int(rng.choice([32, 48, 64])),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=int(rng.choice([8, head_dim // 2])),
        q_lora_rank=int(rng.choice([16, 24, 40])),
        o_groups=int(rng.choice([g for g in (1, 2, 4) if heads % g == 0])),
        o_lora_rank=int(rng.choice([8, 12, 20])),
        sliding_window=int(rng.choice([8, 16, 32])),
        layer_types=layer_types,
        csa_compress_ratio=4,
        hca_compress_ratio=int(rng.choice([8, 16])),
        index_n_heads=int(rng.choice([2, 4, 8])),
        index_head_dim=int(rng.choice([8, 12, 16])),
        index_topk=int(rng.choice([2, 3, 8])),
        mlp_layer_types=tuple([HASH_MOE] * n_hash + [SCORE_MOE] * (n_layers - n_hash)),
        n_routed_experts=experts,
        num_experts_per_tok=int(rng.choice([1, 2, 3])),
        moe_intermediate_size=int(rng.choice([16, 20, 40])),
        hc_mult=int(rng.choice([2, 4])),
        max_position_embeddings=1024,
    )


def load_model(name: str, index: int):
    if name == "bundled":
        return load_checkpoint(default_model_dir(), dtype="float32", mtp="skip")
    cfg = draw_config(np.random.default_rng(1000 + index))
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(index))
    params["head"] = params["head"] * 40.0  # a peaked distribution, as a trained model has
    return cfg, params


def models(spec: str):
    """'bundled,random:3' -> [(label, cfg, params)], loaded one at a time."""
    for part in spec.split(","):
        if part.startswith("random:"):
            for k in range(int(part.split(":")[1])):
                yield (f"random{k}", *load_model("random", k))
        else:
            yield (part, *load_model(part, 0))


def result(req):
    return req.output_token_ids, [req.token_logprobs[i] for i in range(len(req.output_token_ids))]


def record_step_sizes(eng: LLMEngine) -> list[int]:
    """The token count of every step the engine schedules (to show that large buckets were used)."""
    sizes, schedule = [], eng.scheduler.schedule

    def recording():
        plan = schedule()
        sizes.append(plan.num_tokens)
        return plan

    eng.scheduler.schedule = recording
    return sizes


def run_budget(cfg, params, budget: int, invariant: bool, trials: int, rng, layout: dict | None = None) -> dict:
    eng = LLMEngine(cfg, params, EngineConfig(
        max_num_seqs=8, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
        token_buckets=TOKEN_BUCKETS.get(budget), batch_invariant=invariant, **(layout or {}),
    ))
    step_tokens = record_step_sizes(eng)
    vocab = cfg.vocab_size
    needle = np.random.default_rng(1234).integers(2, vocab, NEEDLE_LEN).tolist()
    alone = {}
    for kind, kw in NEEDLE_PARAMS.items():
        req = eng.add_request(needle, SamplingParams(**kw))
        eng.run_until_done()
        alone[kind] = result(req)
    differing = token_mismatch = 0
    for trial in range(trials):
        kind = list(NEEDLE_PARAMS)[trial % 2]
        others = [rng.integers(2, vocab, int(rng.integers(1, min(MAX_OTHER_PROMPT, 8 * budget)))).tolist()
                  for _ in range(int(rng.integers(1, 8)))]
        early = int(rng.integers(0, len(others) + 1))

        def other_sp():
            return SamplingParams(temperature=float(rng.choice([0, 1.0])), seed=int(rng.integers(0, 2**31)),
                                  max_tokens=int(rng.integers(1, 24)), ignore_eos=True)

        for o in others[:early]:
            eng.add_request(o, other_sp())
        for _ in range(int(rng.integers(0, 4))):
            eng.step()
        req = eng.add_request(needle, SamplingParams(**NEEDLE_PARAMS[kind]))
        for o in others[early:]:
            eng.add_request(o, other_sp())
        eng.run_until_done()
        eng.check_all_free()
        got = result(req)
        differing += got != alone[kind]
        token_mismatch += got[0] != alone[kind][0]
    shapes = sorted({(s.num_tokens, s.num_rows) for s in eng.compiled_shapes})
    return {"trials": trials, "differing": differing, "token_mismatch": token_mismatch,
            "largest_step_tokens": max(step_tokens), "shapes": len(shapes)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bundled,random:3")
    ap.add_argument("--budgets", default="13,32,256,2048")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--layout", default="{}", help='the parallel layout as JSON, e.g. {"tensor_parallel_size": 2} '
                    "(with XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)")
    args = ap.parse_args()
    layout = json.loads(args.layout)
    budgets = [int(b) for b in args.budgets.split(",")]
    out: dict = {mode: {} for mode in args.modes.split(",")}
    for label, cfg, params in models(args.models):
        for mode in out:
            rng = np.random.default_rng(99)  # the same batches with the mode on and off
            out[mode][label] = {str(b): run_budget(cfg, params, b, mode == "on", args.trials, rng, layout)
                                for b in budgets}
        print(json.dumps({"model": label, **{m: out[m][label] for m in out}}), file=sys.stderr, flush=True)
        # Each compiled step program holds ~900 memory mappings on XLA CPU; a process runs out
        # (vm.max_map_count 65530, "LLVM compilation error: Cannot allocate memory") after ~70.
        del cfg, params
        gc.collect()
        jax.clear_caches()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
