"""The load balancer's policy (sharding/eplb.py): a pinned worked example, invariants on random loads,
the imbalance it removes on a skewed workload, and its errors."""

import numpy as np
import pytest

from sharding import eplb


def test_worked_example_global():
    """4 experts with loads 10, 2, 1, 1 in 6 slots on 2 devices. Replication gives the two extra slots to
    expert 0 (10/1, then 10/2 = 5 > 2): counts [3, 1, 1, 1], replicas weigh 10/3 each. Packing, heaviest
    first onto the lighter device with room (3 each): 3.33 -> d0, 3.33 -> d1, 3.33 -> d0, 2 -> d1, 1 -> d1,
    1 -> d0: device 0 holds {0, 0, 3} (7.67), device 1 {0, 1, 2} (6.33)."""
    p = eplb.rebalance_experts([[10, 2, 1, 1]], num_slots=6, num_devices=2)
    assert p.phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert p.replica_count.tolist() == [[3, 1, 1, 1]]
    per = eplb.device_loads([[10, 2, 1, 1]], p.phy2log, 2)
    np.testing.assert_allclose(per, [[10 / 3 * 2 + 1, 10 / 3 + 3]])
    assert eplb.imbalance([[10, 2, 1, 1]], eplb.identity(1, 4)[:, :4], 2) == pytest.approx(12 / 7)


def test_invariants_on_random_loads():
    rng = np.random.default_rng(0)
    for policy, kw in (("global", {}), ("hierarchical", dict(num_groups=4, num_nodes=2))):
        loads = rng.integers(0, 1000, (3, 16))
        p = eplb.rebalance_experts(loads, num_slots=24, num_devices=4, policy=policy, **kw)
        assert p.phy2log.shape == (3, 24)
        for row, counts in zip(p.phy2log, p.replica_count):
            assert (np.bincount(row, minlength=16) == counts).all() and (counts >= 1).all() and counts.sum() == 24
        if policy == "hierarchical":  # a group's replicas stay on one node (12 slots each)
            for row in p.phy2log:
                for group in range(4):
                    nodes = {s // 12 for s, e in enumerate(row) if e // 4 == group}
                    assert len(nodes) == 1


def test_skewed_loads_become_even():
    """Zipf-like loads over 64 experts on 8 devices with 16 redundant slots: max / mean tokens per device."""
    rng = np.random.default_rng(1)
    loads = np.stack([rng.permutation(1000 / np.arange(1, 65) ** 1.2) for _ in range(4)])
    before = eplb.imbalance(loads, eplb.identity(4, 64), 8)
    flat = eplb.imbalance(loads, eplb.rebalance_experts(loads, 64, 8).phy2log, 8)  # no replicas: placement only
    after = eplb.imbalance(loads, eplb.rebalance_experts(loads, 80, 8).phy2log, 8)
    print(f"max/mean tokens per device: identity {before:.3f}, balanced {flat:.3f}, with 16 replicas {after:.3f}")
    assert before > 1.5 and flat < before and after < 1.05


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"num_slots \(6\) must split evenly over num_devices \(4\)"):
        eplb.rebalance_experts([[1, 2, 3, 4]], 6, 4)
    with pytest.raises(ValueError, match=r"num_slots \(3\) must be at least the number of experts \(4\)"):
        eplb.rebalance_experts([[1, 2, 3, 4]], 3, 1)
    with pytest.raises(ValueError, match="policy must be one of"):
        eplb.rebalance_experts([[1, 2]], 2, 1, policy="greedy")
    with pytest.raises(ValueError, match="loads must be >= 0"):
        eplb.rebalance_experts([[1, -2]], 2, 1)
    with pytest.raises(ValueError, match="hierarchical: experts"):
        eplb.rebalance_experts([[1, 2, 3, 4]], 4, 2, policy="hierarchical", num_groups=3, num_nodes=2)
