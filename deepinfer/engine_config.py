"""EngineConfig (the engine's settings: batch, budget, buckets, memory, modes) and the sizing of
its KV pools from a memory budget. Read by the engine, LLM() and the server's flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from deepinfer.config import ModelConfig
from deepinfer.kv.paged_state import bytes_per_page, bytes_per_slot
from deepinfer.models.interface import ModelFamily, PagedLayout
from deepinfer.scheduler.queue_order import check_policy
from deepinfer.scheduler.scheduler import PoolSpec
from deepinfer.scheduler.speculation import MAX_DRAFT_TOKENS
from sharding.parallel import ParallelConfig


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out + [hi])


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    page_size: int = 16  # compressed rows per page
    kv_memory_bytes: int | None = None  # None: room for max_num_seqs requests of max_model_len
    num_pages: tuple[tuple[str, int], ...] | None = None  # exact pages per pool (overrides the budget)
    token_buckets: tuple[int, ...] | None = None
    row_buckets: tuple[int, ...] | None = None
    # contexts (tokens) below max_model_len that decode steps get block tables of their own width for
    # (runtime/context_widths.py): None: max_model_len / 4^k down to 1024; (): one width
    context_buckets: tuple[int, ...] | None = None
    max_backtrack: int = 12
    keep_logits: bool = False  # keep each generated token's logits on the request (tests, debugging)
    overlap: bool = True  # plan step N+1 while step N runs; off: wait for each step (comparison, debugging)
    measure_device: bool = False  # time each step on the device from a watcher thread (runtime/step_timer.py)
    # every token's numbers independent of the rest of the batch (bitwise); env DEEPINFER_BATCH_INVARIANT=1
    batch_invariant: bool = field(default_factory=lambda: os.environ.get("DEEPINFER_BATCH_INVARIANT") == "1")
    # speculative decoding, vLLM's shape: {"method": "mtp", "num_speculative_tokens": k}, 1 <= k <= 5;
    # env DEEPINFER_USE_NEXTN_DECODE=k turns it on with k drafts when this is None
    speculative_config: dict | None = None
    # speculating: choose each step how many drafts each request verifies (confidence x measured step
    # cost) instead of always k; env DEEPINFER_ENABLE_MTP_VARLEN=1
    mtp_varlen: bool = field(default_factory=lambda: os.environ.get("DEEPINFER_ENABLE_MTP_VARLEN") == "1")
    # warm-up also compiles the two halves a constrained step (a grammar, or a thinking budget forcing
    # its end marker) runs as with overlap (twice the programs: off by default, so they compile on the
    # first constrained step of each shape instead)
    warm_structured: bool = False
    # prefix caching (scheduler/prefix_cache.py), vLLM's --enable-prefix-caching: blocks of
    # prefix_block_size tokens; snapshots of the per-slot state every prefix_checkpoint_interval
    # prompt tokens and at every prompt's end ("snapshot": exact replay of at most the interval), or
    # "recompute": no snapshots, the family's replay horizon replayed from an empty slot state
    enable_prefix_caching: bool = True
    prefix_block_size: int | None = None  # None: 16, or less where a pool's page spans fewer tokens
    prefix_checkpoint_interval: int = 512
    prefix_replay: str = "snapshot"
    prefix_snapshots: int | None = None  # snapshot store entries (None: 4 per slot)
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (each request's priority, lower
    # first; scheduler/queue_order.py)
    scheduling_policy: str = "fcfs"
    # the parallel layout, vLLM's names (sharding/parallel.py): attention data-parallel ranks, tensor
    # parallel width, routed experts split over every device, context-parallel prefill ranks
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1
    # the expert-parallel load balancer (vLLM's --enable-eplb): tokens per expert counted on the device,
    # placements computed from them (sharding/eplb.py) and applied between steps
    # (runtime/expert_balance.py); num_redundant_experts extra physical slots per layer for replicas of
    # hot experts; eplb_step_interval > 0: rebalance every that many steps, 0: only when asked
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 0
    # decode steps per dispatch (SGLang's --num-continuous-decode-steps): when every row of a step is a
    # plain decode and nothing waits to be admitted, run this many steps in one program (an on-device
    # loop) and read their tokens at once (scheduler/decode_burst.py); 1: one step per dispatch
    num_continuous_decode_steps: int = 1
    # a folder of compiled step programs (runtime/program_store.py): a restart loads them instead of
    # tracing and lowering again; None: none kept (the server puts one in its compile cache)
    program_cache_dir: str | None = None
    # check the allocator invariant after every step (tests; env DEEPINFER_CHECK_INVARIANTS=1)
    check_invariants: bool = field(default_factory=lambda: os.environ.get("DEEPINFER_CHECK_INVARIANTS") == "1")

    def __post_init__(self):
        self.num_speculative_tokens()  # refuse bad values at construction, naming them
        self.parallel()
        self.context_bucket_sizes()
        for key in ("num_redundant_experts", "eplb_step_interval"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {getattr(self, key)!r}")
        if (self.num_redundant_experts or self.eplb_step_interval) and not self.enable_eplb:
            raise ValueError("num_redundant_experts and eplb_step_interval need enable_eplb")
        check_policy(self.scheduling_policy)
        n, most = self.num_continuous_decode_steps, (self.max_backtrack + 1) // 2
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max(most, 1):
            # a request that stops on its first token of a burst still runs to the burst's end, and the
            # step planned after it too: the window rings must keep (2 n - 1) positions past the stop
            raise ValueError(f"num_continuous_decode_steps must be an integer in [1, {max(most, 1)}] (at most "
                             f"(max_backtrack + 1) // 2 with max_backtrack {self.max_backtrack}), got {n!r}")
        if self.prefix_replay not in ("snapshot", "recompute"):
            raise ValueError(f"prefix_replay must be 'snapshot' or 'recompute', got {self.prefix_replay!r}")
        for key in ("prefix_block_size", "prefix_checkpoint_interval"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.prefix_block_size and self.prefix_checkpoint_interval % self.prefix_block_size:
            raise ValueError(f"prefix_checkpoint_interval ({self.prefix_checkpoint_interval}) must be a multiple of "
                             f"prefix_block_size ({self.prefix_block_size})")
        if self.prefix_snapshots is not None and self.prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots must be >= 0, got {self.prefix_snapshots}")

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.data_parallel_size, self.tensor_parallel_size, self.enable_expert_parallel,
                              self.context_parallel_size)

    def num_prefix_snapshots(self) -> int:
        return 4 * self.max_num_seqs if self.prefix_snapshots is None else self.prefix_snapshots

    def num_speculative_tokens(self) -> int:
        """Drafts per decode row (0: speculation off)."""
        spec = self.speculative_config
        if spec is None:
            env = os.environ.get("DEEPINFER_USE_NEXTN_DECODE")
            if env is None or env == "":
                return 0
            if not env.isdigit() or not 1 <= int(env) <= MAX_DRAFT_TOKENS:
                raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE must be an integer in [1, {MAX_DRAFT_TOKENS}], got {env!r}")
            return int(env)
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'mtp', 'num_speculative_tokens': 3}}, "
                             f"got {spec!r}")
        unknown = set(spec) - {"method", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: method, num_speculative_tokens)")
        if spec.get("method", "mtp") != "mtp":
            raise ValueError(f"speculative_config: method must be 'mtp' (the model's own MTP block), got {spec['method']!r}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {k!r}")
        if k > self.max_backtrack:
            raise ValueError(f"speculative_config: num_speculative_tokens {k} exceeds max_backtrack {self.max_backtrack}")
        return k

    def _default_token_buckets(self) -> tuple[int, ...]:
        """Powers of two from 16 to the budget (prefill chunks and large decode steps), and below 16
        those a decode step can fill (max_num_seqs rows of 1 + drafts tokens): 1, 2, 4, 8 for 16
        sequences; 1, 2 for 2 (a 4- or 8-token bucket would only hold short prefill chunks there)."""
        top = self.max_num_batched_tokens
        decode = self.max_num_seqs * (1 + self.num_speculative_tokens())
        small = [b for b in (1, 2, 4, 8) if b < min(16, top) and (b == 1 or b // 2 < decode)]
        return tuple(small) + _powers_of_two(min(16, top), top)

    def buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(token buckets, row buckets). Each token bucket is one program, compiled with the row bucket
        scheduler/buckets.rows_for gives it. The defaults start at 1 so that a small decode step runs in a
        shape of its own size: a batch-1 decode in a 16-token bucket cost 4.6x a 1-token one (bundled
        model, CPU: 10.1 against 2.2 ms)."""
        tokens = self.token_buckets or self._default_token_buckets()
        rows = self.row_buckets or _powers_of_two(1, self.max_num_seqs)
        if tokens[-1] < self.max_num_batched_tokens or rows[-1] < self.max_num_seqs:
            raise ValueError("the largest buckets must cover max_num_batched_tokens and max_num_seqs")
        return tokens, rows

    def context_bucket_sizes(self) -> tuple[int, ...]:
        """Contexts below max_model_len with block tables of their own width, ascending (the
        full width is always there). Default: max_model_len / 4, / 16, ... while >= 1024 (none up to
        max_model_len 2048, where the narrower read saved little: bundled model, CPU, 16 decode rows
        5.7 ms at 1024 against 16.4 ms at 16384, BENCHMARKS.md section 1)."""
        if self.context_buckets is None:
            out, c = [], self.max_model_len // 4
            while c >= 1024:
                out.append(c)
                c //= 4
            return tuple(sorted(out))
        sizes = tuple(self.context_buckets)
        if any(not isinstance(c, int) or isinstance(c, bool) or not 0 < c < self.max_model_len for c in sizes):
            raise ValueError(f"context_buckets must be integers in [1, max_model_len {self.max_model_len}), "
                             f"got {self.context_buckets!r}")
        return tuple(sorted(set(sizes)))


@dataclass
class Capacity:
    num_slots: int
    pools: tuple[PoolSpec, ...]
    bytes_total: int
    tokens: int  # tokens of context the pools can hold in all
    requests_at_max_len: int
    notes: list[str] = field(default_factory=list)


def size_pools(family: ModelFamily, cfg: ModelConfig, ec: EngineConfig, dtype) -> Capacity:
    """Pages per pool from the memory budget (or explicit counts); byte costs measured on the family's state."""
    ratio = {p.name: p.tokens_per_row for p in family.pools(cfg)}
    names = tuple(ratio)
    per_req_pages = {n: max(1, -(-(ec.max_model_len // ratio[n]) // ec.page_size)) for n in names}
    layout_probe = PagedLayout(ec.max_num_seqs, ec.page_size, tuple((n, 1) for n in names), ec.max_backtrack,
                               draft=ec.num_speculative_tokens() > 0)
    slot_bytes = bytes_per_slot(family, cfg, layout_probe, dtype) * ec.max_num_seqs
    page_bytes = {n: bytes_per_page(family, cfg, layout_probe, n, dtype) for n in names}
    if ec.num_pages is not None:
        pages = dict(ec.num_pages)
        missing = set(names) - set(pages)
        if missing:
            raise ValueError(f"num_pages lacks pools {sorted(missing)}")
    else:
        per_req_bytes = sum(per_req_pages[n] * page_bytes[n] for n in names)
        budget = ec.kv_memory_bytes
        if budget is None:
            budget = slot_bytes + per_req_bytes * ec.max_num_seqs
        room = budget - slot_bytes
        n_req = room // per_req_bytes if per_req_bytes else ec.max_num_seqs
        if names and n_req < 1:
            raise ValueError(
                f"kv_memory_bytes={budget} cannot hold the slots ({slot_bytes} B) and one request of "
                f"max_model_len {ec.max_model_len} ({per_req_bytes} B)"
            )
        pages = {n: max(1, int(n_req) * per_req_pages[n]) for n in names}
    specs = tuple(PoolSpec(n, ratio[n], ec.page_size, pages[n]) for n in names)
    tokens = min((s.num_pages * s.page_size * s.ratio for s in specs), default=ec.max_num_seqs * ec.max_model_len)
    per_req = min((s.num_pages // per_req_pages[s.name] for s in specs), default=ec.max_num_seqs)
    total = slot_bytes + sum(s.num_pages * page_bytes[s.name] for s in specs)
    return Capacity(ec.max_num_seqs, specs, total, tokens, min(per_req, ec.max_num_seqs))
