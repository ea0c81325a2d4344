"""`python -m deepinfer`: run the V4 forward on a checkpoint or a config, from the command line.

Loads a checkpoint directory (config.json + safetensors, transformers or official
naming; by default the bundled deepinfer-tiny-v4) or builds a random model from a
config file, then greedily extends a token prompt through the engine (paged KV
state, chunked prefill). The server is `python -m deepinfer.serve`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from deepinfer.default_model import default_model_dir

MAX_RANDOM_PARAMS = 2_000_000_000


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deepinfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model_dir(),
                   help="checkpoint directory, or a config.json for random weights (default: the bundled %(default)s)")
    p.add_argument("--prompt-ids", default="1,2,3,4,5", help="comma-separated prompt token ids (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to generate, >= 1 (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights (config input only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import jax

    from deepinfer.config import ConfigError, ModelConfig
    from deepinfer.engine_config import EngineConfig
    from deepinfer.model_loading import load_model
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.models.deepseek_v4.loader import CheckpointError
    from deepinfer.params import count_params, init_params
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.scheduler.sampling_params import SamplingParams

    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        print(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
        return 2
    if not prompt:
        print("error: --prompt-ids is empty", file=sys.stderr)
        return 2
    if args.new_tokens < 1:
        print(f"error: --new-tokens must be >= 1, got {args.new_tokens}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        if os.path.isdir(args.model):
            cfg, params = load_model(args.model, dtype=args.dtype, mtp="skip")
            source = f"checkpoint {args.model}"
        else:
            cfg = ModelConfig.from_json_file(args.model)
            size = count_params(model_spec(cfg, include_mtp=False))
            if size > MAX_RANDOM_PARAMS:
                print(f"error: {args.model} describes {size:,} parameters; random weights are only built "
                      f"for models up to {MAX_RANDOM_PARAMS:,} (pass a checkpoint directory instead)", file=sys.stderr)
                return 2
            params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(args.seed), args.dtype)
            source = f"random weights (seed {args.seed}) for {args.model}"
    except (OSError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        print(f"error: prompt token ids {bad} are outside the vocabulary (size {cfg.vocab_size})", file=sys.stderr)
        return 2
    n_params = count_params(model_spec(cfg, include_mtp="mtp" in params))
    print(f"model: {source}")
    print(f"parameters: {n_params:,} ({args.dtype}); layers: {', '.join(cfg.layer_types)}")
    print(f"loaded in {time.perf_counter() - start:.2f} s on {jax.devices()[0].platform}")

    # Through the engine: paged KV state, chunked prefill, the jitted ragged step.
    engine = LLMEngine(cfg, params, EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=64, max_model_len=len(prompt) + args.new_tokens + 1,
        token_buckets=(1, 64), row_buckets=(1,),
    ))
    t0 = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    engine.run_until_done()
    elapsed = time.perf_counter() - t0
    print(f"prompt ids: {prompt}")
    print(f"greedy continuation: {req.output_token_ids}")
    print(f"{len(req.output_token_ids)} tokens in {elapsed:.2f} s through the engine "
          f"({engine.num_steps} steps, {len(engine.compiled_shapes)} compiled programs, compile time included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
