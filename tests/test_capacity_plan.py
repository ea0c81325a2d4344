"""The capacity plan's figures (scripts/capacity_plan.py, docs/capacity_v4_flash.md) against numbers
derived another way: DeepSeek's published parameter count and the config's own arithmetic."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
FLASH = os.path.join(ROOT, "configs", "deepseek_v4_flash.json")


@pytest.fixture(scope="module")
def plan():
    import capacity_plan

    return capacity_plan.build(FLASH, "h800", 65536, 8.0, 0.4, 0)


def test_parameter_count_is_the_published_one(plan):
    # DeepSeek: 284B total, 13B active (the MTP block is extra: its own 256 experts)
    assert abs(plan["params"]["total_without_mtp"] / 284e9 - 1) < 0.005
    assert 12.5e9 < plan["params"]["active_per_token"] < 14e9
    assert plan["params"]["total_with_mtp"] > plan["params"]["total_without_mtp"] + 256 * 3 * 2048 * 4096


def test_kv_bytes_per_token_follow_the_layer_schedule(plan):
    # bf16: a CSA layer stores a 512-wide main row and a 128-wide indexer row per 4 tokens, an HCA
    # layer a 512-wide row per 128 tokens; 21 CSA and 20 HCA layers in Flash's schedule
    csa, hca = 21 * (512 + 128) // 4 * 2, 20 * 512 // 128 * 2
    assert plan["kv"]["per_token"] == {"csa": csa, "hca": hca}
    # per decode step at 64k: window rows in all 43 layers, top-512 rows + all indexer keys in CSA, all HCA rows
    window, csa_read, hca_read = 43 * 128 * 512 * 2, 21 * (512 * 512 + 16384 * 128) * 2, 20 * 512 * 512 * 2
    assert plan["kv_read_per_step"][65536] == window + csa_read + hca_read


def test_decode_64_weights_per_device(plan):
    d = plan["layouts"]["decode-64: DP64 attention + EP64 (target)"]
    # 4 of 256 experts per device in 43 layers + the MTP block, FP4 with one ue8m0 byte per 32
    assert d["weights"]["routed experts"] == pytest.approx(44 * 4 * 3 * 2048 * 4096 * (0.5 + 1 / 32))
    # DP attention replicates the rest; bf16 embedding and head whole
    assert d["weights"]["embedding + head"] == 2 * 129280 * 4096 * 2
    dec = d["decode"]
    assert [x["batch"] for x in dec][:3] == [8, 32, 64] and dec[-1]["batch"] == dec[-1]["sequences_fit"]
    # more sequences, more tokens per device, fewer per sequence
    assert all(a["tok_s_per_device"] <= b["tok_s_per_device"] for a, b in zip(dec, dec[1:]))
    assert all(a["tok_s_per_sequence"] >= b["tok_s_per_sequence"] for a, b in zip(dec, dec[1:]))


def test_cli_prints_the_tables():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "capacity_plan.py"), "--device", "h200"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "284.3 B without MTP" in proc.stdout and "H200 SXM" in proc.stdout
    assert "| decode-64: DP64 attention + EP64 (target) | 257 |" in proc.stdout
