"""Run in a subprocess with fake CPU devices (the device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel_run '{"tensor_parallel_size": 2}' ... [eplb]

The bundled model through the engine, once on one device and once per layout given (JSON), on one
mixed workload: prompts longer than the token budget (chunked prefill), pools too small for all
of them at once (preemption), greedy and seeded requests, warm-up then a check that nothing
compiles. Prints one JSON line per run: tokens, each generated token's logits' max |difference|
from the one-device run, compiles after warm-up, preemptions, and the step program's collectives.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from deepinfer.engine_config import EngineConfig
from deepinfer.llm import LLM
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.step_program import lower_step
from deepinfer.scheduler.sampling_params import SamplingParams
from sharding.collectives import collectives, in_control_flow

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4, token_buckets=(8, 32),
              num_pages=(("csa", 8), ("hca", 4)), keep_logits=True,
              prefix_checkpoint_interval=16)  # snapshots often enough for the last prompt's hit
PROMPT_LENS = [3, 41, 9, 57, 20, 33]
MAX_TOKENS = [10, 8, 12, 6, 9, 11, 7]


def workload(vocab: int):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(5, vocab, n).tolist() for n in PROMPT_LENS]
    prompts.append(prompts[3][:40] + [11, 12, 13])  # a prefix-cache hit on the longest prompt's blocks
    # every other request sampled with its own seed: the noise is f(seed, position, token), so it must agree
    params = [SamplingParams(max_tokens=m, temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    return prompts, params


def run(cfg, params, layout: dict) -> dict:
    engine = LLMEngine(cfg, params, EngineConfig(**ENGINE, **layout))
    engine.warmup()
    prompts, sps = workload(cfg.vocab_size)
    with CompileCounter(all_threads=True) as compiles:
        reqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
        engine.run_until_done()
    engine.check_all_free()
    followup = data_parallel_followup(engine, prompts, sps, reqs) if engine.ranks > 1 else None
    smallest = engine.bucket_shapes()[0]
    text = lower_step(engine, smallest).compile().as_text()
    found = collectives(text)
    largest = max((s for s in engine.bucket_shapes() if s.steps == 1), key=lambda s: s.num_tokens)
    texts = [text] + ([lower_step(engine, largest).compile().as_text()] if largest != smallest else [])
    store = engine.prefix.store[0]
    return {
        # the prefix cache's operations program: what it moves between devices, and the snapshot store's
        # entries per device (data parallelism: a rank's own)
        "cache_ops_collectives": [(c.kind, c.shapes, c.bytes) for shape in engine.prefix.shapes()
                                  for c in collectives(engine.prefix.lower(shape).compile().as_text())],
        "store_entries": [store.shape[0], store.sharding.shard_shape(store.shape)[0]],
        "followup": followup,
        "engine": engine,
        "tokens": [list(r.output_token_ids) for r in reqs],
        "logits": [np.stack(r.logits) for r in reqs],
        "compiles_after_warmup": compiles.count,
        "preemptions": engine.scheduler.num_preemptions,
        "collectives": [(c.kind, c.shapes, c.bytes) for c in found],
        # run by a loop (per iteration) or only by a conditional's branch, in the smallest or the largest step
        **{f"{kind}_collectives": [(c.kind, c.shapes) for t in texts for c in in_control_flow(t)[kind]]
           for kind in ("loop", "branch")},
    }


def data_parallel_followup(engine, prompts, sps, reqs) -> dict:
    """Attention data-parallel: the prefix-sharing prompt again once the workload is done goes to the rank
    whose cache holds its prefix (not the least-loaded rank) and hits there."""
    hits = engine.stats().prefix_hits
    req = engine.add_request(prompts[6], sps[6], request_id="again")
    engine.run_until_done()
    engine.check_all_free()
    return {"tokens": list(req.output_token_ids), "rank": req.dp_rank, "hit": engine.stats().prefix_hits - hits,
            "first_rank": reqs[6].dp_rank, "ranks": [r.dp_rank for r in reqs]}


def weight_and_pool_shapes(engine) -> set:
    """Shapes of every weight and model-state leaf (rings, pools), whole and per device: a collective
    producing one of these moves a weight or a pool (what the design never does inside a step). The
    runtime's per-slot [S, V] counts are left out: a step's [R, V] logits share their shape when R = S."""
    shapes = set()
    for a in jax.tree.leaves((engine.params, engine.state.model)):
        if a.size >= 4096:  # small leaves (norm vectors) coincide with activations' shapes
            shapes.add(tuple(a.shape))
            shapes.add(tuple(a.sharding.shard_shape(a.shape)))
    return shapes


# prefix caching off: both runs of the workload then process the same tokens, so the counted loads
# can be compared exactly (the layouts above run with it on)
EPLB = {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True,
        "num_redundant_experts": 4, "enable_prefix_caching": False}


def eplb_check(cfg, params, base: dict) -> dict:
    """Expert placement changed between workloads: the same tokens, nothing compiled but the one program
    that moves the expert weights, and the per-device load figures of the counted (skewed) loads."""
    from deepinfer.runtime import expert_balance

    engine = LLMEngine(cfg, params, EngineConfig(**ENGINE, **EPLB))
    engine.warmup()
    prompts, sps = workload(cfg.vocab_size)
    out = {}
    for phase in ("first", "rebalanced"):
        with CompileCounter(all_threads=True) as compiles:
            reqs = [engine.add_request(p, sp, request_id=f"{phase}{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
            engine.run_until_done()
        out[phase] = [list(r.output_token_ids) for r in reqs]
        out[f"compiles_{phase}"] = compiles.count
        if phase == "first":
            out["loads"] = expert_balance.expert_loads(engine).tolist()
            with CompileCounter(all_threads=True) as compiles:
                out["figures"] = expert_balance.rebalance(engine)
            out["compiles_rebalance"] = compiles.count
            out["placement"] = engine.expert_placement.tolist()
    engine.check_all_free()
    out.update(same_tokens=out["first"] == out["rebalanced"] == base["tokens"],
               loads_second=expert_balance.expert_loads(engine).tolist())  # counted from zero again
    return out


def structured_check(cfg, params) -> dict:
    """Attention data-parallel with constrained rows (a thinking budget forces its end marker through the
    grammar bitmask): with overlap such a step runs as two programs, the model half then the sampling
    half (runtime/data_parallel.dp_forward / dp_sample). The tokens against one device's."""
    import dataclasses

    prompts, sps = workload(cfg.vocab_size)
    sps = [dataclasses.replace(sp, thinking_token_budget=3, reasoning_end_token_ids=(7, 8)) if i % 3 == 0 else sp
           for i, sp in enumerate(sps)]
    out = {}
    for name, layout in (("one", {}), ("dp", {"data_parallel_size": 2, "enable_expert_parallel": True})):
        engine = LLMEngine(cfg, params, EngineConfig(**ENGINE, warm_structured=True, **layout))
        engine.warmup()
        reqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
        engine.run_until_done()
        engine.check_all_free()
        out[name] = [list(r.output_token_ids) for r in reqs]
    return out


def burst_check(cfg, params) -> dict:
    """Decode bursts and narrower block tables under attention data-parallel (DP2 + EP2): the ranks' rows
    run two steps per dispatch in one program, each step in the narrowest table its rows fit. Tokens
    against one device without either, bursts and narrow programs counted, nothing compiled after warm-up."""
    prompts, sps = workload(cfg.vocab_size)
    out = {}
    plain = {k: v for k, v in ENGINE.items() if k != "keep_logits"}  # (a burst returns tokens only)
    for name, extra in (("one", {}), ("dp", {"data_parallel_size": 2, "enable_expert_parallel": True,
                                             "num_continuous_decode_steps": 2, "context_buckets": (32, 64)})):
        engine = LLMEngine(cfg, params, EngineConfig(**plain, **extra))
        engine.warmup()
        narrow = []
        run = engine._run
        engine._run = lambda plan, shape: (narrow.append(shape.max_pages != engine.max_pages), run(plan, shape))[1]
        with CompileCounter(all_threads=True) as compiles:
            reqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
            engine.run_until_done()
        engine.check_all_free()
        out[name] = [list(r.output_token_ids) for r in reqs]
        out[f"{name}_bursts"], out[f"{name}_narrow"] = engine.num_decode_bursts, sum(narrow)
        out[f"{name}_compiles"] = compiles.count
    return out


def load_check(params) -> dict:
    """LLM() on a TP4 + EP layout: every weight read from the checkpoint lands on its devices as it is
    loaded (runtime/mesh_setup.load_shardings), so placing the tree on the mesh afterwards moves none."""
    import sharding.placement as placement

    moved, put = [], placement._put

    def spy(a, s):
        if getattr(a, "sharding", None) != s:
            moved.append(list(a.shape))
        return put(a, s)

    placement._put = spy
    try:
        llm = LLM(None, warmup=False, show_progress=False, max_num_seqs=2, max_model_len=128, tensor_parallel_size=4,
                  enable_expert_parallel=True, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    finally:
        placement._put = put
    leaves = jax.tree.leaves(llm.engine.params)
    # with EPLB the loaded (split) experts are then laid into their physical slots, 12 over 4 devices
    eplb = LLM(None, warmup=False, show_progress=False, max_num_seqs=2, max_model_len=128, **EPLB).engine
    slots = eplb.params["layers"][2]["ffn"]["experts"]["w1"]
    want = np.asarray(params["layers"][2]["ffn"]["experts"]["w1"])[np.asarray(eplb.expert_placement)[2]]
    return {"moved": moved, "leaves": len(leaves), "devices": sorted({len(a.sharding.device_set) for a in leaves}),
            "eplb_slots_equal": bool(np.array_equal(np.asarray(slots), want)), "eplb_slots_shape": list(slots.shape),
            "eplb_slot_devices": len(slots.sharding.device_set),
            "experts_spec": [list(x) if isinstance(x, tuple) else x
                             for x in llm.engine.params["layers"][2]["ffn"]["experts"]["w1"].sharding.spec]}


def main(layouts: list[dict]) -> None:
    # the bundled model's weights, with the MTP block (a layout may speculate)
    llm = LLM(None, warmup=False, show_progress=False, max_num_seqs=1,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    cfg, params = llm.cfg, llm.engine.params
    if layouts == ["structured"]:
        print("STRUCTURED " + json.dumps(structured_check(cfg, params)), flush=True)
        return
    if layouts == ["bursts"]:
        print("BURSTS " + json.dumps(burst_check(cfg, params)), flush=True)
        return
    base = run(cfg, params, {})
    print("LOAD " + json.dumps(load_check(params)), flush=True)
    if "eplb" in layouts:
        layouts = [x for x in layouts if x != "eplb"]
        print("EPLB " + json.dumps(eplb_check(cfg, params, base)), flush=True)
    # speculating: greedy requests only (sampled ones draw other noise than without speculation)
    greedy = [i for i, sp in enumerate(workload(cfg.vocab_size)[1]) if sp.temperature == 0]
    for layout in [{}] + layouts:
        out = base if not layout else run(cfg, params, layout)
        moved = weight_and_pool_shapes(out["engine"])
        compared = greedy if layout.get("speculative_config") else range(len(base["tokens"]))
        diff = max(float(np.abs(out["logits"][i][:n] - base["logits"][i][:n]).max()) for i in compared
                   for n in [min(len(out["logits"][i]), len(base["logits"][i]))]) if layout else 0.0
        print("RESULT " + json.dumps({
            "layout": layout,
            "tokens": out["tokens"],
            "same_tokens": [out["tokens"][i] for i in compared] == [base["tokens"][i] for i in compared],
            "prefix_hits": out["engine"].stats().prefix_hits,
            "logits_max_abs_diff": diff,
            "logits_scale": float(max(np.abs(x).max() for x in base["logits"])),
            "compiles_after_warmup": out["compiles_after_warmup"],
            "preemptions": out["preemptions"],
            "devices": len(out["engine"].params["embed"].sharding.device_set),
            "followup": out["followup"],
            "collectives": out["collectives"],
            "cache_ops_collectives": out["cache_ops_collectives"],
            "loop_collectives": out["loop_collectives"],
            "branch_collectives": out["branch_collectives"],
            "store_entries": out["store_entries"],
            "weight_or_pool_moved": [c for c in out["collectives"]
                                     if any(tuple(s) in moved for _, s in c[1])],
        }), flush=True)


if __name__ == "__main__":
    main([a if a in ("eplb", "structured", "bursts") else json.loads(a) for a in sys.argv[1:]])
