"""One engine start on the bundled model with a program store (tests/test_program_store.py runs it
twice in fresh processes): background warm-up with the constrained-step halves, a greedy workload and
thinking-budget rows (the halves run), then prints what it traced, loaded and saved, and the tokens."""

import json
import sys

import jax.monitoring

from deepinfer.llm import LLM
from deepinfer.scheduler.sampling_params import SamplingParams

STEP_FUNCTIONS = {"paged_step", "paged_burst", "paged_forward_step", "paged_sample_step"}


def main(folder: str, extra: dict) -> None:
    traced = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: traced.append(kw.get("fun_name")) if event.endswith("jaxpr_trace_duration") else None)
    llm = LLM(warmup=False, show_progress=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=(4, 16), warm_structured=True, program_cache_dir=folder, **extra)
    engine = llm.engine
    engine.warmup(background=True)
    assert engine.wait_warm(timeout=600)
    prompts = [[5 + i, 17, 300 + 7 * i, 42] * (1 + i) for i in range(6)]
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True,
                                                 thinking_token_budget=2 if i % 2 else None,
                                                 reasoning_end_token_ids=(7, 8)))
            for i, p in enumerate(prompts)]
    engine.run_until_done()
    store = engine.programs.step.store
    print(json.dumps({"tokens": [r.output_token_ids for r in reqs], "loaded": store.loaded, "saved": store.saved,
                      "step_traces": sum(name in STEP_FUNCTIONS for name in traced)}))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})  # extra LLM() arguments
