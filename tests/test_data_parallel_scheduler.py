"""Attention data-parallel on the host (scheduler/data_parallel.py): requests placed on ranks, each
rank's own slots / pages / budget, one composite plan whose rows the ranks update, cache operations in
global ids, and the packed step of every rank (runtime/data_parallel.pack). The device side is
tests/test_parallel_engine.py (8 fake devices, against the one-device engine)."""

import numpy as np

from deepinfer.scheduler.data_parallel import DataParallelScheduler
from deepinfer.scheduler.plan import INT_FIELDS_R, INT_FIELDS_T, PlanShape
from deepinfer.scheduler.prefix_steps import CacheOps
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import PoolSpec, SchedulerConfig

POOLS = (PoolSpec("csa", ratio=4, page_size=2, num_pages=16), PoolSpec("hca", ratio=8, page_size=2, num_pages=8))


def make(ranks=2, max_num_seqs=2, budget=16):
    return DataParallelScheduler(SchedulerConfig(max_num_seqs, budget, 64, max_num_seqs, POOLS, (1,)), ranks)


def req(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(2, 2 + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_requests_go_to_the_least_loaded_rank_and_each_rank_has_its_own_slots_and_budget():
    s = make(ranks=2, max_num_seqs=2, budget=16)
    reqs = [req(f"r{i}", 12) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    assert [r.dp_rank for r in reqs] == [0, 1, 0, 1, 0]
    plan = s.schedule()
    # every rank fills its own 16-token budget and 2 slots: r4 waits on rank 0
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("r0", 12), ("r2", 4), ("r1", 12), ("r3", 4)]
    assert [[r.request_id for r, _ in part.scheduled] for part in plan.parts] == [["r0", "r2"], ["r1", "r3"]]
    assert sorted((r.dp_rank, r.slot) for r in reqs[:4]) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # local slots
    assert [r.request_id for r in s.waiting] == ["r4"] and len(s.running) == 4
    assert s.slots.num_slots == 4 and s.slots.num_free == 0


def test_the_ranks_record_a_composite_plan_and_drain_to_all_free():
    s = make(ranks=3, max_num_seqs=2, budget=32)
    reqs = [req(f"r{i}", 5 + i, max_tokens=3) for i in range(7)]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_unfinished:
        plan = s.schedule()
        # the parts share the composite's per-request records (the engine writes the composite's)
        assert all(p.outputs is plan.outputs and p.drafts is plan.drafts for p in plan.parts)
        s.update(plan, {r.request_id: 7 for r, _ in plan.scheduled if plan.samples(r)})
        s.check_invariant()
        steps += 1
        assert steps < 50
    assert all(r.output_token_ids == [7, 7, 7] and r.finish_reason == "length" for r in reqs)
    s.check_all_free()


def test_waiting_is_one_queue_in_arrival_order_and_assigning_it_keeps_each_request_on_its_rank():
    s = make(ranks=2, max_num_seqs=1)
    reqs = [req(f"r{i}", 4) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["r0", "r1", "r2", "r3"]
    s.waiting = [reqs[3], reqs[0]]  # (recovery reorders the queue)
    assert [r.request_id for r in s.ranks[0].waiting] == ["r0"] and [r.request_id for r in s.ranks[1].waiting] == ["r3"]


def test_cache_operations_are_translated_to_the_engine_states_global_ids():
    s = make(ranks=2, max_num_seqs=4)
    ops = CacheOps(saves=[(1, 0)], restores=[(2, 0)], clears=[2], copies=[("csa", 3, 5), ("hca", 0, 1)],
                   marks=[(2, 9, 1)])
    into = CacheOps()
    s._translate(1, ops, into)
    entries = 0  # no prefix cache: no snapshot entries
    assert into.saves == [(5, entries)] and into.restores == [(6, entries)] and into.clears == [6]
    assert into.copies == [("csa", 19, 21), ("hca", 8, 9)] and into.marks == [(6, 9, 1)]


def test_each_rank_is_packed_alone_with_its_local_ids_and_the_rows_order_maps_back():
    from deepinfer.runtime.data_parallel import pack
    from deepinfer.scheduler.plan import Packer

    s = make(ranks=2, max_num_seqs=2, budget=16)
    reqs = [req(f"r{i}", n) for i, n in enumerate([3, 5, 2])]
    for r in reqs:
        s.add_request(r)
    plan = s.schedule()
    shape = PlanShape(8, 2, (4, 2))
    seeds = {r.request_id: 0 for r in reqs}
    inputs = pack(plan, Packer(POOLS, 2, 100, (1,)), shape, 2, seeds)
    assert inputs.ints.shape == (2, shape.int_size) and inputs.floats.shape == (2, shape.float_size)
    t = shape.num_tokens
    slot_at = len(INT_FIELDS_T) * t + INT_FIELDS_R.index("slot") * shape.num_rows
    tokens_of = lambda rank: inputs.ints[rank, :t]  # noqa: E731
    assert tokens_of(0).tolist() == [2, 3, 4, 2, 3, 0, 0, 0]  # r0 (3 tokens) then r2 (2), local to rank 0
    assert tokens_of(1).tolist() == [2, 3, 4, 5, 6, 0, 0, 0]  # r1 alone on rank 1
    assert inputs.ints[0, slot_at : slot_at + 2].tolist() == [0, 1] and inputs.ints[1, slot_at : slot_at + 2].tolist() == [0, 2]
    # the composite's rows r0, r2, r1 -> rank 0 row 0, rank 0 row 1, rank 1 row 0
    assert [r.request_id for r, _ in plan.scheduled] == ["r0", "r2", "r1"]
    assert inputs.rows[:3].tolist() == [0, 1, 2] and np.asarray(plan.output_rows).tolist() == inputs.rows.tolist()
    # its tokens: rank 0's five, then rank 1's from offset T
    assert inputs.tokens[:10].tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]


def test_a_prompt_goes_where_its_prefix_is_in_flight_unless_that_rank_is_much_busier():
    """Cache-aware placement before anything is cached: a prompt sharing whole blocks with a request
    queued on a rank goes there (its blocks will be cached there), not to the idle rank, until that rank
    holds num_slots // 2 more requests than the least busy; other tenants' prompts do not count."""
    from deepinfer.scheduler.prefix_cache import CacheSettings

    config = SchedulerConfig(4, 64, 64, 4, POOLS, (1,), prefix_cache=CacheSettings(block_size=8, checkpoint_interval=16,
                                                                                     num_snapshots=4))
    s = DataParallelScheduler(config, 2)
    system = list(range(100, 124))  # three whole blocks

    def ask(rid, tail, salt=None):
        r = Request(rid, system + tail, SamplingParams(max_tokens=2, ignore_eos=True), cache_salt=salt)
        s.add_request(r)
        return r.dp_rank

    assert ask("a", [1, 2, 3]) == 0
    assert ask("c", [4, 5]) == 0  # by load alone it would go to idle rank 1
    assert ask("e", [6]) == 0  # rank 0 holds 2 more than rank 1: still within num_slots // 2 = 2
    assert ask("f", [7]) == 1  # 3 more would be too many: the least busy rank takes it
    assert ask("g", [8]) == 1  # both ranks have the prefix in flight now: the less busy one
    assert ask("t", [9], salt="tenant") == 1  # another tenant shares nothing: by load (2 against 3)
    unrelated = Request("u", list(range(200, 230)), SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request(unrelated)
    assert unrelated.dp_rank == 0  # loads 3 and 3: the lowest rank
