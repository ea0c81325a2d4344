"""Run in a fresh process (the platform must be chosen before JAX starts): the bundled model through
LLM() on the platform DEEPINFER_PLATFORM / DEEPINFER_PJRT_PLUGIN name (unset: JAX's default CPU), greedy,
a few prompts; prints one JSON line {"platform", "kernels", "tokens"}."""

from __future__ import annotations

import json

import jax

from deepinfer.llm import LLM
from deepinfer.runtime.platform import platform_in_use
from deepinfer.scheduler.sampling_params import SamplingParams

PROMPTS = ["Hello, how are you?", "What is the capital of France?", "Tell me a story about a dragon."]


def main() -> None:
    llm = LLM(warmup=False, show_progress=False, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
              token_buckets=(32,), row_buckets=(4,))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    print(json.dumps({"platform": platform_in_use(), "kernels": llm.engine.cfg.kernels.describe(),
                      "client": jax.devices()[0].client.platform_version,
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    main()
