"""A data-parallel engine's prefix cache saved and loaded (2 fake CPU devices, DP2, the bundled model):

    python -m tests.prefix_persistence_dp_run DIRECTORY

Two prompts go to the two ranks (each the least loaded when it arrives) and are cached there; the
cache is saved; the engine that never restarted then serves a prompt sharing each one's prefix, and
so does a new DP2 engine after loading the file. A one-rank engine's refusal of the file is recorded
too. Prints "RESULT <json>".
"""

from __future__ import annotations

import json
import os
import sys

from tests.subprocess_env import xla_flags


def main(directory: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = xla_flags(2)  # the suite's optimisation level kept
    from deepinfer.default_model import default_model_dir
    from deepinfer.engine_config import EngineConfig
    from deepinfer.models.deepseek_v4.loader import load_checkpoint
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.runtime.prefix_persistence import load_prefix_cache, save_prefix_cache
    from deepinfer.scheduler.sampling_params import SamplingParams
    from tests.prefix_cases import base_prompt, sharing

    cfg, params = load_checkpoint(default_model_dir(), mtp="skip")
    kw = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=32, token_buckets=(8, 32), context_buckets=(),
              prefix_checkpoint_interval=32, check_invariants=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    a, b = base_prompt(cfg.vocab_size, 90, seed=1), base_prompt(cfg.vocab_size, 75, seed=5)

    def served(engine, prompts):
        reqs = [engine.add_request(p, greedy) for p in prompts]  # together: each rank takes one
        engine.run_until_done()
        engine.check_all_free()
        return [{"rank": r.dp_rank, "cached": r.num_cached_tokens, "tokens": list(r.output_token_ids)} for r in reqs]

    first = LLMEngine(cfg, params, EngineConfig(data_parallel_size=2, **kw))
    cold = served(first, [a, b])
    summary = save_prefix_cache(first, directory)
    later = [sharing(a, 70, cfg.vocab_size), sharing(b, 60, cfg.vocab_size)]
    continued = served(first, later)
    restarted = LLMEngine(cfg, params, EngineConfig(data_parallel_size=2, **kw))
    loaded = load_prefix_cache(restarted, directory)
    restarted.check_all_free()
    after = served(restarted, later)
    try:
        load_prefix_cache(LLMEngine(cfg, params, EngineConfig(**kw)), directory)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    print("RESULT " + json.dumps({"cold": cold, "summary": summary, "loaded": loaded, "continued": continued,
                                  "after": after, "refusal": refusal}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
