"""Bytes moved between devices per engine step, read from the compiled step program (not timed: on
fake CPU devices speed means nothing, but the program XLA builds for the mesh is the real one).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/collectives.py

For each layout, on the bundled model: one decode-shaped step (max_num_seqs rows of one token) and
one prefill-shaped step (the largest token bucket), each collective kind's count and result bytes.
Then the expert-parallel MoE's exchange on paper for V4-Flash shapes: the all-reduce this engine
uses without data parallelism (tokens on every expert device) against an all-to-all dispatch +
combine (tokens split over devices, as attention data-parallel has them; under it this engine
gathers the ranks' tokens and reduce-scatters the sums instead). Writes benchmarks/results/collectives.json.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.runtime.step_program import lower_step  # noqa: E402
from sharding.collectives import collectives, in_control_flow, summary  # noqa: E402

LAYOUTS = [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4},
           {"tensor_parallel_size": 2, "enable_expert_parallel": True},
           {"tensor_parallel_size": 4, "enable_expert_parallel": True},
           # attention data-parallel (max_num_seqs and the token budget are per rank: 16 rows / 256 tokens each)
           {"data_parallel_size": 2, "tensor_parallel_size": 4, "enable_expert_parallel": True},
           {"data_parallel_size": 8, "enable_expert_parallel": True},
           {"data_parallel_size": 4, "tensor_parallel_size": 2},
           {"context_parallel_size": 4, "enable_expert_parallel": True}]
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024)


def measured(cfg, params) -> list[dict]:
    rows = []
    for layout in LAYOUTS:
        engine = LLMEngine(cfg, params, EngineConfig(**ENGINE, **layout))
        shapes = engine.bucket_shapes()
        decode = next(s for s in shapes if s.num_tokens >= ENGINE["max_num_seqs"])
        for kind, shape in (("decode", decode), ("prefill", shapes[-1])):
            text = lower_step(engine, shape).compile().as_text()
            found = summary(collectives(text))
            # a collective in a loop runs once per iteration; one in a conditional's branch on some steps only
            inside = {k: len(v) for k, v in in_control_flow(text).items()}
            rows.append({"layout": layout, "step": kind, "tokens": shape.num_tokens, "rows": shape.num_rows,
                         "collectives": found, "bytes": sum(b for _, b in found.values()),
                         "in_loops": inside["loop"], "in_branches": inside["branch"]})
            print(f"{str(layout):58s} {kind:8s} T={shape.num_tokens:4d} " + "  ".join(
                f"{k} x{n} {b / 1024:.1f} KiB" for k, (n, b) in sorted(found.items()))
                + f"  (in loops {inside['loop']}, in branches {inside['branch']})", flush=True)
    return rows


def on_paper(tokens_per_device: int, ep: int, top_k: int, hidden: int, bytes_per: int = 2) -> dict:
    """Bytes one device receives per MoE layer. All-reduce (ring) of [N, D] replicated tokens:
    2 (ep-1)/ep N D. All-to-all with N tokens split over ep devices: each token's activation goes to
    the devices of its k experts (at most k distinct) and comes back: 2 N k D / ep received."""
    n_total = tokens_per_device * ep
    allreduce = 2 * (ep - 1) / ep * n_total * hidden * bytes_per
    alltoall = 2 * n_total * min(top_k, ep) * hidden * bytes_per / ep
    return {"tokens_per_device": tokens_per_device, "ep": ep, "allreduce_MiB": allreduce / 2**20,
            "alltoall_MiB": alltoall / 2**20}


def main() -> None:
    llm = LLM(None, warmup=False, show_progress=False, max_num_seqs=1)
    rows = measured(llm.cfg, llm.engine.params)
    flash = ModelConfig.from_json_file(os.path.join(ROOT, "configs", "deepseek_v4_flash.json"))
    paper = [on_paper(n, ep, flash.num_experts_per_tok, flash.hidden_size) for ep in (4, 8, 64) for n in (64, 4096)]
    print("V4-Flash MoE exchange per layer per device (bf16):")
    for p in paper:
        print(f"  EP{p['ep']:<3d} {p['tokens_per_device']:5d} tokens/device: all-reduce {p['allreduce_MiB']:8.2f} MiB, "
              f"all-to-all {p['alltoall_MiB']:8.2f} MiB")
    write_record({"measured": rows, "v4_flash_on_paper": paper}, os.path.join(ROOT, "benchmarks", "results",
                                                                          "collectives.json"))


if __name__ == "__main__":
    main()
