"""The engine on a mesh of 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts)
equals the one-device engine on a mixed workload (chunked prefill, preemption, greedy and seeded):
tokens identical, logits within fp32 tolerance, nothing compiled after warm-up, and the step program
communicates activations only (no weight or KV pool re-sharded inside a step). Layouts: tensor
parallel, expert parallel, attention data-parallel (each rank its own slots, pools and requests)
with and without them, MTP speculation on a mesh."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepinfer.engine_config import EngineConfig
from sharding.parallel import ParallelConfig
from tests.subprocess_env import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4, "enable_expert_parallel": True},
           # attention data-parallel: DP2 x EP4 (TP4 inside each rank), DP8 + EP8, TP2 x DP4 (experts split by
           # width, no expert parallelism)
           {"data_parallel_size": 2, "tensor_parallel_size": 4, "enable_expert_parallel": True},
           {"data_parallel_size": 8, "enable_expert_parallel": True},
           {"data_parallel_size": 4, "tensor_parallel_size": 2},
           # context parallel: each step's tokens split over 4 devices (prefill chunks, and decode steps of
           # at least 4 tokens), the experts over the same 4
           {"context_parallel_size": 4, "enable_expert_parallel": True},
           # MTP speculation on a DP2 x TP2 mesh, experts over all 4 (the drafter's MoE exchanges tokens
           # between ranks too): greedy requests compared
           {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}]


def ranks(layout: dict) -> int:
    return layout.get("data_parallel_size", 1)


@pytest.fixture(scope="module")
def parallel_runs():
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_run", *map(json.dumps, LAYOUTS), "eplb"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["layout"] for r in runs] == [{}] + LAYOUTS
    eplb = [json.loads(line[len("EPLB "):]) for line in proc.stdout.splitlines() if line.startswith("EPLB ")]
    load = [json.loads(line[len("LOAD "):]) for line in proc.stdout.splitlines() if line.startswith("LOAD ")]
    return runs, eplb[0], load[0]


@pytest.fixture(scope="module")
def eplb_run(parallel_runs):
    return parallel_runs[1]


def test_the_one_device_run_exercises_the_workload(parallel_runs):
    base = parallel_runs[0][0]
    assert base["preemptions"] > 0 and base["compiles_after_warmup"] == 0
    assert [len(t) for t in base["tokens"]] == [10, 8, 12, 6, 9, 11, 7]
    assert base["prefix_hits"] > 0  # the last prompt reuses the longest one's cached blocks


@pytest.mark.parametrize("i", range(1, len(LAYOUTS) + 1), ids=[json.dumps(x) for x in LAYOUTS])
def test_layout_equals_one_device(parallel_runs, i):
    run, base = parallel_runs[0][i], parallel_runs[0][0]
    assert run["devices"] == (run["layout"].get("tensor_parallel_size", 1) * ranks(run["layout"])
                              * run["layout"].get("context_parallel_size", 1))
    # speculating, the greedy requests (sampled ones draw other noise than without speculation)
    assert run["same_tokens"], (run["tokens"], base["tokens"])
    if not run["layout"].get("speculative_config"):
        assert run["tokens"] == base["tokens"]
    else:
        assert [len(t) for t in run["tokens"]] == [len(t) for t in base["tokens"]]
    # fp32: the partial sums of split matmuls and experts are added in another order
    assert run["logits_max_abs_diff"] < 1e-4 * base["logits_scale"], run["logits_max_abs_diff"]
    assert run["compiles_after_warmup"] == 0
    if ranks(run["layout"]) <= 2:
        # (4 or 8 ranks: the 7 requests spread to at most 2 a rank, which its pools hold; and the request
        # sharing the prefix, on its owner's rank, is admitted while the owner is still prefilling it)
        assert run["preemptions"] > 0 and run["prefix_hits"] > 0


@pytest.mark.parametrize("i", [i for i, x in enumerate(LAYOUTS, 1) if ranks(x) > 1],
                         ids=[json.dumps(x) for x in LAYOUTS if ranks(x) > 1])
def test_data_parallel_places_a_request_where_its_prefix_is_cached(parallel_runs, i):
    """Requests spread over the ranks (least loaded first), but the prompt sharing the longest one's prefix
    joins that one's rank while it is still in flight; once the workload is done, it comes again and goes
    to the rank whose cache holds its prefix (not the first idle rank), hits there and gives the
    one-device tokens."""
    run, base = parallel_runs[0][i], parallel_runs[0][0]
    followup = run["followup"]
    placed = followup["ranks"]
    assert sorted(set(placed[:6])) == list(range(min(ranks(run["layout"]), 6)))
    assert placed[6] == placed[3]  # (request 3 owns the shared prefix)
    assert followup["rank"] == followup["first_rank"] and followup["hit"] >= 32
    assert followup["tokens"] == base["tokens"][6]
    if ranks(run["layout"]) > 2:
        assert followup["rank"] != 0  # the workload put it elsewhere: a placement by load alone would not


@pytest.mark.parametrize("i", range(1, len(LAYOUTS) + 1), ids=[json.dumps(x) for x in LAYOUTS])
def test_step_moves_activations_only(parallel_runs, i):
    run = parallel_runs[0][i]
    kinds = {c[0] for c in run["collectives"]}
    # (DP8: the MoE's gather of 8 ranks x 8 tokens x hidden 256 is shaped like the [64, 256] kv projections)
    tokens_gathered = [["f32", [ranks(run["layout"]) * 8, 256]]]
    assert [c for c in run["weight_or_pool_moved"] if c[:2] != ["all-gather", tokens_gathered]] == []
    # split projections are summed (all-reduce) and the split vocabulary's logits gathered whole once
    assert "all-reduce" in kinds and "all-gather" in kinds
    # no distributed sort over a split vocabulary, no re-sharding shuffles
    assert "collective-permute" not in kinds and "all-to-all" not in kinds, sorted(kinds)
    # what a layer exchanges, it exchanges once per step, in the smallest step and the largest: nothing in a
    # loop's body, and in a conditional's branch only gathers made whole for prompt logprobs (the rows'
    # logits, or under context parallelism their hidden states; only when a request asks). Tensor parallelism
    # without expert parallelism once left the MoE's partial sums to the partitioner, which put an
    # all-reduce in the CPU's pair loop (one per pair) and one in each expert's branch. (Not for the
    # speculative layout: its step runs in a switch over sampling-grid widths, one branch per step, and the
    # drafter's MTP layer in a loop, once per draft position, each with its exchanges.)
    if "speculative_config" not in run["layout"]:
        assert run["loop_collectives"] == [], run["loop_collectives"]
        assert {c[0] for c in run["branch_collectives"]} <= {"all-gather"}, run["branch_collectives"]
    if run["layout"].get("enable_expert_parallel") and ranks(run["layout"]) == 1:
        # the experts' partial sums: one all-reduce of the step's [T, D] activations per MoE layer
        # (context parallel: of [T, D], the tokens gathered from the context-parallel devices first)
        moe_sums = [c for c in run["collectives"] if c[0] == "all-reduce" and c[1] in ([["f32", [1, 8, 256]]],
                                                                                       [["f32", [8, 256]]])]
        assert len(moe_sums) >= 4, run["collectives"]
    elif run["layout"].get("enable_expert_parallel"):
        # data-parallel ranks: each MoE layer gathers every rank's [T, D] tokens and scatters the sums
        # back, each rank keeping its own T (one reduce-scatter per MoE layer, 4 in the bundled model)
        t, d, n = 8, 256, ranks(run["layout"])
        gathers = [c for c in run["collectives"] if c[0] == "all-gather" and c[1] == [["f32", [n * t, d]]]]
        scatters = [c for c in run["collectives"] if c[0] == "reduce-scatter" and c[1] == [["f32", [t, d]]]]
        assert len(gathers) >= 4 and len(scatters) >= 4, run["collectives"]


@pytest.mark.parametrize("i", range(1, len(LAYOUTS) + 1), ids=[json.dumps(x) for x in LAYOUTS])
def test_prefix_cache_operations_stay_on_their_rank(parallel_runs, i):
    """The snapshot store is split by rank under data parallelism (each device holds its rank's entries,
    not every rank's), and the program that saves, restores and copies moves nothing between devices
    (before: a replicated store, and an all-reduce of the saved rows in every dispatch)."""
    run = parallel_runs[0][i]
    total, per_device = run["store_entries"]
    assert per_device * ranks(run["layout"]) == total
    assert run["cache_ops_collectives"] == []


def test_llm_loads_each_weight_straight_onto_the_mesh(parallel_runs):
    """A V4-Flash does not fit on one device first: LLM() reads each weight into its sharding, so placing
    the tree afterwards moves nothing (the MTP block included, speculation on)."""
    load = parallel_runs[2]
    assert load["moved"] == [] and load["leaves"] > 100
    assert load["devices"] == [4]  # every leaf on the 4-device mesh (split or replicated)
    assert load["experts_spec"] == [["dp", "cp", "tp"], None, None]
    # EPLB on the same mesh: the split experts laid into 8 + 4 redundant slots hold the right weights
    assert load["eplb_slots_equal"] and load["eplb_slots_shape"][0] == 12 and load["eplb_slot_devices"] == 4


def test_layout_settings_are_checked_and_named():
    assert EngineConfig(tensor_parallel_size=2).parallel() == ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(data_parallel_size=2, context_parallel_size=2).parallel().world_size == 4
    with pytest.raises(ValueError, match="the layout needs 4 devices .* 1 are visible"):
        ParallelConfig(tensor_parallel_size=4).plan([object()])
    with pytest.raises(ValueError, match="unknown keys \\['tp'\\]"):
        ParallelConfig.from_dict({"tp": 2})


def test_server_refuses_a_layout_it_cannot_run_before_loading(capsys):
    from deepinfer.serve.__main__ import main

    assert main(["--data-parallel-size", "2", "--context-parallel-size", "2"]) == 2
    assert "the layout needs 4 devices (data 2 x context 2 x tensor 1); 1 are visible" in capsys.readouterr().err
    assert main(["--tensor-parallel-size", "4"]) == 2  # one CPU device in this process
    assert "the layout needs 4 devices" in capsys.readouterr().err


@pytest.mark.slow  # ~45 s; the lockstep server over 2 processes runs by default (tests/test_multiprocess_server.py)
def test_two_processes_run_one_engine_equal_to_one_device():
    """jax.distributed on loopback: 2 processes x 4 fake CPU devices, one engine with tensor parallel 8 and
    expert parallel over all 8 devices (tests/multiprocess_run.py); every process gets the one-device streams."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: the child keeps its level
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_run", str(i), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    results = [json.loads(line[len("RESULT "):]) for out, _ in outs for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert [(r["process"], r["processes"], r["devices"]) for r in results] == [(0, 2, 8), (1, 2, 8)]
    assert results[0]["mesh"] == results[1]["mesh"]  # every request, the unseeded one too: one agreed seed
    assert results[0]["mesh"][:4] == results[0]["alone"][:4]  # (the engine alone drew another seed for the 5th)
    assert [len(t) for t in results[0]["mesh"]] == [8, 8, 8, 8, 8]


def test_eplb_placement_changes_between_steps_without_recompiling_or_changing_outputs(eplb_run):
    """DP2 x TP2 with EP4 and 4 redundant slots (12 per layer, 3 per device): loads counted on the device (each
    data-parallel rank's tokens, summed over the ranks), a placement computed from them and applied between
    two runs of the workload; the tokens are those of one device."""
    r = eplb_run
    assert r["same_tokens"]
    # no step program compiled again: only the rebalance's own two small ones (the expert-weight move,
    # shared by every layer, and the counters' reset)
    assert r["compiles_first"] == r["compiles_rebalanced"] == 0 and r["compiles_rebalance"] <= 2
    loads, second = np.array(r["loads"]), np.array(r["loads_second"])
    assert loads.shape == (4, 8)
    # every token processed counted once per layer per chosen expert (k = 2), from zero after the rebalance
    assert (loads.sum(1) == loads.sum(1)[0]).all() and (second.sum(1) == loads.sum(1)).all()
    placement = np.array(r["placement"])
    assert placement.shape == (4, 12) and all(set(row) == set(range(8)) for row in placement)
    assert r["figures"]["after"] <= r["figures"]["before"]


@pytest.mark.slow
def test_data_parallel_decode_bursts_in_narrow_tables_equal_one_device():
    """Decode bursts of 2 steps and narrower block tables under DP2 + EP2: the one-device tokens (the
    workload of the layouts above, its greedy and seeded requests), both used, nothing compiled later
    (~100 s; `pytest -m slow -k decode_bursts_in_narrow`)."""
    env = cpu_devices_env(2)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_run", "bursts"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = next(json.loads(line[len("BURSTS "):]) for line in proc.stdout.splitlines() if line.startswith("BURSTS "))
    assert out["dp"] == out["one"]
    assert out["one_bursts"] == out["one_narrow"] == 0  # the one-device run has neither
    assert out["dp_bursts"] > 0 and out["dp_narrow"] > 0, out
    assert out["dp_compiles"] == 0 == out["one_compiles"]


@pytest.mark.slow
def test_data_parallel_steps_with_constrained_rows_equal_one_device():
    """Constrained rows under attention data-parallel (the model and sampling halves as two programs, with
    overlap), DP2 + EP2 against one device (~70 s; `pytest -m slow -k constrained_rows`)."""
    env = cpu_devices_env(2)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_run", "structured"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = next(json.loads(line[len("STRUCTURED "):]) for line in proc.stdout.splitlines()
               if line.startswith("STRUCTURED "))
    assert out["dp"] == out["one"]
    assert all(t[3:5] == [7, 8] for t in out["one"][::3])  # the budget's end marker forced after 3 tokens
