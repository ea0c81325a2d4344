"""Prefix caching on the host: content-addressed blocks over the paged pools, and snapshots of
the per-slot state at checkpoints. No JAX; the device side is runtime/prefix_ops.py.

Blocks. A request's tokens are cut into blocks of ``block_size`` tokens; a block's digest
chains its parent's digest, its tokens and the request's salt (``cache_salt``: tenants with
different salts share nothing), and a lookup verifies the tokens and the parent too, so a
digest collision is a miss, never a wrong hit. A block records, per pool, the page holding
the compressed rows its tokens close (with every row of that page before it correct), and
holds a reference on it; ``block_size`` divides every pool's page span (page_size x ratio),
so a block lies inside one page of each pool.

Alignment. Pools cover different spans (CSA 4 x page_size tokens a page, HCA 128 x
page_size) and the sliding state is per slot, so a hit of H tokens is assembled per part:
each pool's pages that end at or before H are shared by reference (no copy); a pool's page
that H ends inside is copied into a fresh page of the request (copy on write: the request
will write rows past H into it), from the block that covers token H - 1; the per-slot state
comes from a snapshot. H can end anywhere: after the last whole matching block, the children
of that block (whole blocks, or the partial block a checkpoint left at the end of a prompt)
are compared token by token.

Snapshots (exact bounded replay). The per-slot state (window rings, compressor rings, the
MTP ring) is saved at checkpoints: every ``checkpoint_interval`` tokens of a prompt (the
scheduler cuts prefill chunks there), at the end of every prompt, and when a request
finishes or is preempted (a multi-turn chat continues from there). A snapshot taken at
position e serves a restore to any length c in [e - max_backtrack, e] (the rings keep that
many extra entries, as rollback does). On a hit the engine restores the latest snapshot at or
below H (or one at most max_backtrack above it) and replays the tokens from there to H with
pool writes suppressed below H (``write_from``): at most ``checkpoint_interval`` tokens.
With a drafter the replay starts one token earlier, so the MTP block, which lags one token,
is fed the request's own next token. The checkpoint-free mode ("recompute") keeps no
snapshots and replays the family's ``replay_horizon`` tokens from an empty slot state; the
snapshot mode does the same when that replays less (the snapshots it would need were evicted).

Lifetime. Blocks a running request holds (hit or written) are never evicted; the others form
an LRU (leaves first, so a chain is cut from its end) evicted only when a pool needs pages.
Snapshot entries are their own LRU. Every page is free, held by requests, or held by blocks;
``check`` verifies the reference counts against that after any step.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from deepinfer.scheduler.allocators import OutOfPages, PageAllocator

SNAPSHOT, RECOMPUTE = "snapshot", "recompute"


@dataclass(eq=False)
class Block:
    digest: bytes
    parent: "Block | None"
    tokens: tuple[int, ...]
    start: int  # position of its first token
    pages: dict[str, int | None]  # pool -> page holding the rows its tokens close (None: no row there yet)
    snapshot: int | None = None  # store entry holding the per-slot state at ``end``
    users: int = 0  # running requests holding it
    children: dict[bytes, "Block"] = field(default_factory=dict)
    last_used: int = 0
    root: bytes = b""  # the salt's root digest (where a first block is listed)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Hit:
    tokens: int  # H: the prefix whose pool rows come from the cache
    restore_len: int  # c: the request continues computing from here (the replay is H - c)
    snapshot: int | None  # store entry restored into the slot (None: recompute mode)
    history_start: int  # recompute mode: the replay starts from an empty slot state here
    path: list[Block]  # the matching whole blocks from position 0
    partial: Block | None  # the child block H ends inside, if any


@dataclass(frozen=True)
class CacheSettings:
    block_size: int = 16
    checkpoint_interval: int = 512
    num_snapshots: int = 64
    mode: str = SNAPSHOT
    horizon: int | None = None  # tokens replayed from an empty slot state (recompute mode; snapshot mode's fallback)
    max_backtrack: int = 12
    drafting: bool = False  # the slot state has an MTP ring that lags one token


def common_prefix(a, b) -> int:  # how many leading tokens the two sequences share
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, settings: CacheSettings, allocators: dict[str, PageAllocator], spans: dict[str, tuple[int, int]]):
        """``spans``: pool -> (tokens per row, rows per page)."""
        s = settings
        for name, (ratio, page_size) in spans.items():
            if (ratio * page_size) % s.block_size:
                raise ValueError(f"prefix cache block size {s.block_size} must divide pool {name!r}'s page span "
                                 f"({page_size} rows x {ratio} tokens)")
        if s.checkpoint_interval % s.block_size:
            raise ValueError(f"checkpoint interval {s.checkpoint_interval} must be a multiple of the block size "
                             f"{s.block_size}")
        if s.mode not in (SNAPSHOT, RECOMPUTE):
            raise ValueError(f"prefix cache replay mode must be {SNAPSHOT!r} or {RECOMPUTE!r}, got {s.mode!r}")
        if s.mode == RECOMPUTE and s.horizon is None:
            raise ValueError("the recompute replay mode needs a model whose per-slot state has a bounded horizon")
        self.settings, self.pools, self.spans = s, allocators, spans
        self._blocks: dict[bytes, Block] = {}
        self._holds: dict[str, dict[int, int]] = {name: {} for name in spans}  # pool -> page -> blocks on it
        self._roots: dict[bytes, dict[bytes, Block]] = {}  # salt digest -> first blocks
        self._tick = itertools.count(1)
        self._evictable: list = []  # heap of (last_used, n, block)
        self._n = itertools.count()
        self._snap_free = list(range(s.num_snapshots - 1, -1, -1)) if s.mode == SNAPSHOT else []
        self._snap_owner: dict[int, Block] = {}
        self.pinned: set[int] = set()  # entries a planned restore reads (until the cache ops are dispatched)
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # tokens that skipped prefill
        self.replayed = 0  # tokens replayed between a restore and the hit
        self.num_hits = 0
        self.num_evicted = 0  # blocks evicted to make room

    # -- hashing --------------------------------------------------------------------

    @staticmethod
    def root(salt: str | None) -> bytes:
        return hashlib.blake2b(b"deepinfer-prefix" + (salt or "").encode(), digest_size=16).digest()

    @staticmethod
    def digest(parent: bytes, tokens) -> bytes:
        return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()

    def _children(self, parent: Block | None, root: bytes) -> dict[bytes, Block]:
        return parent.children if parent is not None else self._roots.setdefault(root, {})

    # -- lookup -----------------------------------------------------------------------

    def lookup(self, tokens: list[int], salt: str | None, limit: int) -> Hit | None:
        """The longest cached prefix of tokens[:limit] that can be restored, or None."""
        s = self.settings
        root = d = self.root(salt)
        path: list[Block] = []
        parent = None
        for i in range(limit // s.block_size):
            chunk = tokens[i * s.block_size : (i + 1) * s.block_size]
            d = self.digest(d, chunk)
            blk = self._blocks.get(d)
            if blk is None or blk.parent is not parent or list(blk.tokens) != chunk:
                break
            path.append(blk)
            parent = blk
        pos = len(path) * s.block_size
        rest = tokens[pos:limit]
        partial, lcp = None, 0
        for child in self._children(parent, root).values() if rest else ():
            if child.tokens[0] != rest[0]:  # most children of a popular prefix differ at once
                continue
            n = common_prefix(child.tokens, rest)
            better = n > lcp or (n == lcp and n and child.snapshot is not None and partial.snapshot is None)
            if better:
                partial, lcp = child, n
        hit_len = pos + lcp
        if hit_len < s.block_size:  # too short to be worth a restore
            return None
        restore = self._restore_point(path, partial, hit_len)
        if restore is None:
            return None
        c, entry, history = restore
        tick = next(self._tick)
        for blk in path + ([partial] if partial is not None else []):
            blk.last_used = tick
        return Hit(hit_len, c, entry, history, path, partial)

    def _restore_point(self, path: list[Block], partial: Block | None, hit_len: int):
        """(c, snapshot entry, history start) for a hit of hit_len tokens, or None when nothing is saved.
        Snapshot mode falls back to replaying the horizon when that replays less (snapshots evicted)."""
        s = self.settings
        fallback = max(0, hit_len - s.horizon) if s.horizon is not None else 0
        best = None  # (snapshot end, entry)
        if s.mode == RECOMPUTE:
            pass
        elif partial is not None and partial.snapshot is not None and partial.end - hit_len <= s.max_backtrack:
            best = (partial.end, partial.snapshot)
        else:
            best = next(((b.end, b.snapshot) for b in reversed(path) if b.snapshot is not None), None)
        c = 0
        if best is not None:
            c = min(best[0], hit_len)
            if s.drafting and c > 0 and best[0] - (c - 1) <= s.max_backtrack:
                c -= 1  # feed the MTP block, one token behind, the request's own next token
        if fallback > c:
            return fallback, None, fallback
        return (c, best[1], 0) if c > 0 else None

    # -- admission ----------------------------------------------------------------------

    def admit(self, hit: Hit) -> tuple[dict[str, list[int]], list[tuple[str, int, int]]]:
        """The request's pages for a hit: whole pages shared, the one H ends inside copied into a
        fresh page ((pool, src, dst) copies). The path's blocks are held until ``release``."""
        s = self.settings
        for blk in hit.path:  # held first, so that making room for the copies cannot evict them
            self._use(blk)
        if hit.partial is not None:
            hit.partial.users += 1
        pages: dict[str, list[int]] = {name: [] for name in self.spans}
        copies = []
        try:
            for name, (ratio, page_size) in self.spans.items():
                span = ratio * page_size
                full = hit.tokens // span
                for j in range(full):
                    page = hit.path[(j + 1) * span // s.block_size - 1].pages[name]
                    self.pools[name].share(page)
                    pages[name].append(page)
                if hit.tokens // ratio > full * page_size:  # rows of the prefix inside a page it does not fill
                    last = (hit.tokens - 1) // s.block_size
                    src = (hit.path[last] if last < len(hit.path) else hit.partial).pages[name]
                    if self.pools[name].num_free < 1:
                        self.evict(name, 1)
                    dst = self.pools[name].allocate(1)[0]
                    pages[name].append(dst)
                    copies.append((name, src, dst))
        except OutOfPages:
            for name, own in pages.items():
                self.pools[name].free(own)
            self.release(list(hit.path))
            raise
        finally:
            if hit.partial is not None:
                hit.partial.users -= 1
                self._maybe_evictable(hit.partial)
        if hit.snapshot is not None:
            self.pinned.add(hit.snapshot)
        return pages, copies

    def record(self, queried: int, hit: Hit | None) -> None:
        """Count an admitted request's lookup of ``queried`` tokens and its hit (metrics, benchmarks)."""
        self.queries += queried
        if hit is None:
            return
        self.num_hits += 1
        self.hits += hit.restore_len
        self.replayed += hit.tokens - hit.restore_len

    # -- registration -------------------------------------------------------------------

    def register(self, chain: list[Block], tokens: list[int], upto: int, pages: dict[str, list[int]],
                 salt: str | None) -> None:
        """Extend a request's chain (its held blocks, in order) with the whole blocks of tokens[:upto]."""
        s = self.settings
        root = self.root(salt)
        while (len(chain) + 1) * s.block_size <= upto:
            i = len(chain)
            blk = self._find_or_add(chain[-1] if chain else None, root, tokens[i * s.block_size : (i + 1) * s.block_size],
                                    i * s.block_size, pages)
            self._use(blk)
            chain.append(blk)

    def checkpoint(self, chain: list[Block], tokens: list[int], end: int, pages: dict[str, list[int]],
                   salt: str | None) -> int | None:
        """Cache tokens[:end] (whole blocks on the chain, then a partial block) and attach a snapshot
        of the state at ``end``. Returns the store entry the state must be saved to, or None (recompute
        mode, or one is there already)."""
        s = self.settings
        if end <= 0:
            return None
        self.register(chain, tokens, end, pages, salt)
        k = end // s.block_size  # the chain may reach past end (a hit's blocks beyond its restore point)
        if end % s.block_size == 0:
            blk = chain[k - 1]
        else:  # a partial block, so that a hit can end exactly here (its pages: the partial pages)
            start = k * s.block_size
            blk = self._find_or_add(chain[k - 1] if k else None, self.root(salt), tokens[start:end], start, pages)
            self._maybe_evictable(blk)
        if s.mode != SNAPSHOT or not s.num_snapshots or blk.snapshot is not None:
            return None
        entry = self._take_entry()
        if entry is None:
            return None
        blk.snapshot = entry
        self._snap_owner[entry] = blk
        blk.last_used = next(self._tick)
        return entry

    def _find_or_add(self, parent: Block | None, root: bytes, chunk: list[int], start: int,
                     pages: dict[str, list[int]]) -> Block:
        d = self.digest(parent.digest if parent is not None else root, chunk)
        blk = self._blocks.get(d)
        if blk is not None and blk.parent is parent and list(blk.tokens) == chunk:
            return blk
        if blk is not None:  # a digest collision: keep the older block, do not cache this one
            return Block(d, parent, tuple(chunk), start, {})
        own = {}
        for name, (ratio, page_size) in self.spans.items():
            idx = start // (ratio * page_size)
            held = pages.get(name, [])
            own[name] = held[idx] if idx < len(held) else None
            if own[name] is not None:
                self.pools[name].share(own[name])
                self._holds[name][own[name]] = self._holds[name].get(own[name], 0) + 1
        blk = Block(d, parent, tuple(chunk), start, own, last_used=next(self._tick), root=root)
        self._blocks[d] = blk
        self._children(parent, root)[d] = blk
        return blk

    # -- holding and releasing ------------------------------------------------------------

    def _use(self, blk: Block) -> None:
        blk.users += 1
        blk.last_used = next(self._tick)

    def release(self, chain: list[Block]) -> None:
        for blk in chain:
            blk.users -= 1
            self._maybe_evictable(blk)
        chain.clear()

    def _maybe_evictable(self, blk: Block) -> None:
        if blk.users == 0 and not blk.children and blk.digest in self._blocks:
            heapq.heappush(self._evictable, (blk.last_used, next(self._n), blk))

    # -- eviction -------------------------------------------------------------------------

    def evict(self, pool: str, need: int) -> bool:
        """Evict least recently used blocks until ``pool`` has ``need`` free pages. False: it cannot."""
        alloc = self.pools[pool]
        while alloc.num_free < need and self._evictable:
            last_used, _, blk = heapq.heappop(self._evictable)
            if blk.users or blk.children or self._blocks.get(blk.digest) is not blk or blk.last_used != last_used:
                if not blk.users and not blk.children and self._blocks.get(blk.digest) is blk:
                    self._maybe_evictable(blk)  # touched since it was queued: queue it again
                continue
            self._remove(blk)
            self.num_evicted += 1
        return alloc.num_free >= need

    def _remove(self, blk: Block) -> None:
        del self._blocks[blk.digest]
        self._children(blk.parent, blk.root).pop(blk.digest, None)
        for name, page in blk.pages.items():
            if page is not None:
                self.pools[name].free([page])
                held = self._holds[name]
                held[page] -= 1
                if not held[page]:
                    del held[page]
        if blk.snapshot is not None:
            self._snap_owner.pop(blk.snapshot, None)
            self._snap_free.append(blk.snapshot)
            blk.snapshot = None
        if blk.parent is not None:
            self._maybe_evictable(blk.parent)

    def _take_entry(self) -> int | None:
        if not self._snap_free:
            victims = [(b.last_used, e) for e, b in self._snap_owner.items() if e not in self.pinned]
            if not victims:
                return None
            _, entry = min(victims)
            self._snap_owner.pop(entry).snapshot = None
            self._snap_free.append(entry)
        return self._snap_free.pop()

    def clear(self) -> None:
        """Forget everything (the device state was rebuilt). Requests must hold no blocks."""
        for blk in list(self._blocks.values()):
            for name, page in blk.pages.items():
                if page is not None:
                    self.pools[name].free([page])
            blk.snapshot = None
        self._blocks.clear()
        self._holds = {name: {} for name in self.spans}
        self._roots.clear()
        self._evictable.clear()
        self._snap_free = list(range(self.settings.num_snapshots - 1, -1, -1)) if self.settings.mode == SNAPSHOT else []
        self._snap_owner.clear()
        self.pinned.clear()

    # -- accounting -------------------------------------------------------------------------

    def page_refs(self) -> dict[str, dict[int, int]]:
        """pool -> page -> references the blocks hold (kept up to date; do not modify)."""
        return self._holds

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snap_owner)
