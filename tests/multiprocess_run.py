"""One process of a two-process engine (jax.distributed on loopback, 4 fake CPU devices each):

    python -m tests.multiprocess_run PROCESS_ID PORT

Both processes run the same program (JAX's multi-controller model): the same random model from
one seed, one engine with tensor parallel 8 + expert parallel over all 8 devices of both
processes, the same requests. Each also runs the workload on its own first device alone (no mesh):
the reference. Prints "RESULT <json>" with both token streams.
"""

from __future__ import annotations

import json
import os
import sys

from tests.subprocess_env import xla_flags


def main(process_id: int, port: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = xla_flags(4)  # the suite's optimisation level kept
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

    import numpy as np

    from deepinfer.config import ModelConfig
    from deepinfer.engine_config import EngineConfig
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.params import init_params
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.scheduler.sampling_params import SamplingParams

    # tiny_mixed with 8 heads, 8 experts and MLP widths of 32: all split evenly over 8 devices
    cfg = ModelConfig.from_json_file("configs/tiny_mixed.json").replace(
        num_attention_heads=8, index_n_heads=8, n_routed_experts=8, moe_intermediate_size=32)
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(11))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 37, 12, 50)]
    sps = [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.9, seed=i, ignore_eos=True)
           for i in range(len(prompts))]
    # sampled without a seed: each process would draw its own (runtime/process_agreement.py)
    prompts.append(rng.integers(3, cfg.vocab_size, 7).tolist())
    sps.append(SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    common = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4, token_buckets=(8, 32))

    def streams(config: EngineConfig) -> list[list[int]]:
        engine = LLMEngine(cfg, params, config)
        reqs = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(prompts, sps))]
        engine.run_until_done()
        engine.check_all_free()
        return [list(r.output_token_ids) for r in reqs]

    mesh_run = streams(EngineConfig(**common, tensor_parallel_size=8, enable_expert_parallel=True))
    alone = streams(EngineConfig(**common))
    print("RESULT " + json.dumps({"process": process_id, "processes": jax.process_count(),
                                  "devices": jax.device_count(), "mesh": mesh_run, "alone": alone}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
