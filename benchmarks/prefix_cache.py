"""Prefix caching: time to first token on a hit vs a miss, tokens replayed per hit, a multi-turn
chat workload with the cache on vs off, and what each replay mode costs per cached token.

    python benchmarks/prefix_cache.py [--models bundled,mid] [--system-len 2048] [--new-len 32]
                                      [--conversations 8] [--turns 6] [--skip-chat]

TTFT: a fresh --system-len-token system prompt plus --new-len new tokens (a miss), then the same
system prompt with other new tokens (a hit), max_tokens=1, best of 3 trials (each trial a new
system prompt), with the snapshot mode and the recompute mode. Multi-turn: --conversations chats
of --turns turns (a 512-token shared system prompt, 32-token user turns, 32-token answers), each
turn's prompt the whole history; every round submits all chats' next turn at once; wall time
with the cache on vs off, the same engine settings otherwise, measured one after the other in
this run. Memory: bytes per cached token of the pools' rows, and of the snapshots (one per
checkpoint interval) in snapshot mode, for the bundled model, mid and V4-Flash (abstract shapes,
bf16). Random weights for mid; the bundled model's own. Prints a table and one JSON record
(benchmarks/results/prefix_cache.json). CPU unless a GPU is present.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.kv.paged_state import bytes_per_page  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.models.deepseek_v4.family import DeepSeekV4  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.models.interface import PagedLayout  # noqa: E402
from deepinfer.params import init_params  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.runtime.prefix_ops import snapshot_bytes  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402


def load(name: str):
    if name == "bundled":
        return load_checkpoint(default_model_dir(), mtp="skip")
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", f"{name}.json"))
    return cfg, init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))


def make_engine(cfg, params, max_len: int, mode: str | None, seqs: int = 4) -> LLMEngine:
    ec = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=256, max_model_len=max_len,
                      enable_prefix_caching=mode is not None, prefix_replay=mode or "snapshot")
    engine = LLMEngine(cfg, params, ec)
    engine.warmup()
    return engine


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    engine.run_until_done()
    return time.perf_counter() - t0


def measure_ttft(cfg, params, system_len: int, new_len: int, mode: str, trials: int = 3) -> dict:
    engine = make_engine(cfg, params, system_len + 2 * new_len + 64, mode)
    rng = np.random.default_rng(0)
    ttft(engine, rng.integers(2, cfg.vocab_size, system_len + new_len).tolist())  # first-use compiles
    miss, hit, replayed = [], [], []
    for _ in range(trials):
        system = rng.integers(2, cfg.vocab_size, system_len).tolist()
        miss.append(ttft(engine, system + rng.integers(2, cfg.vocab_size, new_len).tolist()))
        before = engine.stats()
        hit.append(ttft(engine, system + rng.integers(2, cfg.vocab_size, new_len).tolist()))
        after = engine.stats()
        replayed.append(after.prefix_replayed - before.prefix_replayed)
        assert after.prefix_hits > before.prefix_hits, "the second request did not hit"
    engine.check_all_free()
    return {"mode": mode, "miss_s": min(miss), "hit_s": min(hit), "speedup": min(miss) / min(hit),
            "replayed_per_hit": max(replayed)}


def chat_workload(cfg, params, conversations: int, turns: int, on: bool) -> dict:
    sys_len, user_len, answer_len = 512, 32, 32
    max_len = sys_len + turns * (user_len + answer_len) + 64
    engine = make_engine(cfg, params, max_len, "snapshot" if on else None, seqs=conversations)
    rng = np.random.default_rng(5)
    system = rng.integers(2, cfg.vocab_size, sys_len).tolist()
    histories = [system[:] for _ in range(conversations)]
    sp = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    # one warm round on other tokens (first-use compiles), then the measured workload
    for h in [rng.integers(2, cfg.vocab_size, sys_len + user_len).tolist() for _ in range(conversations)]:
        engine.add_request(h, sp)
    engine.run_until_done()
    cached = generated = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        reqs = []
        for i in range(conversations):
            histories[i] = histories[i] + rng.integers(2, cfg.vocab_size, user_len).tolist()
            reqs.append(engine.add_request(histories[i], sp))
        engine.run_until_done()
        for i, r in enumerate(reqs):
            histories[i] = histories[i] + r.output_token_ids
            cached += r.num_cached_tokens
            generated += len(r.output_token_ids)
    wall = time.perf_counter() - t0
    engine.check_all_free()
    return {"cache": on, "wall_s": wall, "generated": generated, "cached_prompt_tokens": cached,
            "tokens_per_s": generated / wall, "requests": conversations * turns}


def memory_per_token(name: str, cfg: ModelConfig, interval: int) -> dict:
    """Bytes one cached token costs: its pools' rows; snapshot mode adds one snapshot per interval."""
    family = DeepSeekV4()
    layout = PagedLayout(1, 16, tuple((p.name, 1) for p in family.pools(cfg)), 12)
    rows = sum(bytes_per_page(family, cfg, layout, p.name, jnp.bfloat16) / (16 * p.tokens_per_row)
               for p in family.pools(cfg))
    snap = snapshot_bytes(family, cfg, layout, jnp.bfloat16)
    return {"model": name, "pool_rows_per_token": rows, "snapshot_bytes": snap,
            "snapshot_mode_per_token": rows + snap / interval, "recompute_mode_per_token": rows,
            "recompute_replay_tokens": family.replay_horizon(cfg, layout), "checkpoint_interval": interval}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,mid")
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--new-len", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--skip-chat", action="store_true")
    args = ap.parse_args()
    record = {"device": jax.devices()[0].platform, "ttft": {}, "chat": {}, "memory": []}
    interval = EngineConfig().prefix_checkpoint_interval
    for name in args.models.split(","):
        cfg, params = load(name)
        record["ttft"][name] = [measure_ttft(cfg, params, args.system_len, args.new_len, m)
                                for m in ("snapshot", "recompute")]
        for r in record["ttft"][name]:
            print(f"{name:8s} TTFT {args.system_len}+{args.new_len} ({r['mode']:9s}): miss {r['miss_s'] * 1e3:8.1f} ms"
                  f"  hit {r['hit_s'] * 1e3:7.1f} ms  x{r['speedup']:.1f}  replayed {r['replayed_per_hit']} tokens")
        if not args.skip_chat:
            runs = [chat_workload(cfg, params, args.conversations, args.turns, on) for on in (True, False)]
            record["chat"][name] = {"on": runs[0], "off": runs[1], "speedup": runs[1]["wall_s"] / runs[0]["wall_s"]}
            print(f"{name:8s} chat {args.conversations}x{args.turns}: on {runs[0]['wall_s']:.2f} s, off "
                  f"{runs[1]['wall_s']:.2f} s, x{record['chat'][name]['speedup']:.2f} "
                  f"({runs[0]['cached_prompt_tokens']} prompt tokens reused)")
    for name, path in (("bundled", os.path.join(default_model_dir(), "config.json")),
                       ("mid", os.path.join(ROOT, "configs", "mid.json")),
                       ("DeepSeek-V4-Flash", os.path.join(ROOT, "configs", "deepseek_v4_flash.json"))):
        m = memory_per_token(name, ModelConfig.from_json_file(path), interval)
        record["memory"].append(m)
        print(f"{name:18s} per cached token: rows {m['pool_rows_per_token']:8.0f} B; snapshot mode "
              f"{m['snapshot_mode_per_token']:8.0f} B (snapshots of {m['snapshot_bytes'] / 2**20:.2f} MiB every "
              f"{interval} tokens); recompute mode {m['recompute_mode_per_token']:8.0f} B, replaying "
              f"{m['recompute_replay_tokens']} tokens per hit")
    write_record(record, os.path.join(ROOT, "benchmarks", "results", "prefix_cache.json"))


if __name__ == "__main__":
    main()
