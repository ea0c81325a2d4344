"""A prefix cache's blocks as plain data, and back: what a restarted engine needs to reuse them.

Only an idle cache is exported (no running request holds a block), so every block's pages are
held by blocks alone. Importing into an empty cache over free pools puts each block back on the
very pages it names; the device side (runtime/prefix_persistence.py) restores those pages' rows
and the snapshot entries bit for bit. Each block's digest is recomputed from its parent and
tokens on import, so a corrupted or hand-edited file cannot produce a wrong hit.
"""

from __future__ import annotations

import itertools

from deepinfer.scheduler.prefix_cache import Block, PrefixCache


def export_blocks(cache: PrefixCache) -> list[dict]:
    """Every block, parents before children, as JSON-ready dicts."""
    blocks = list(cache._blocks.values())
    if any(b.users for b in blocks):
        raise RuntimeError("the prefix cache can only be saved while no request holds its blocks (engine idle)")
    index: dict[int, int] = {}
    order: list[Block] = []

    def visit(b: Block) -> None:
        if id(b) in index:
            return
        if b.parent is not None:
            visit(b.parent)
        index[id(b)] = len(order)
        order.append(b)

    for b in blocks:
        visit(b)
    return [
        {
            "parent": index[id(b.parent)] if b.parent is not None else -1,
            "root": b.root.hex(),
            "digest": b.digest.hex(),
            "tokens": list(b.tokens),
            "start": b.start,
            "pages": b.pages,
            "snapshot": b.snapshot,
            "last_used": b.last_used,
        }
        for b in order
    ]


def import_blocks(cache: PrefixCache, data: list[dict]) -> None:
    """Rebuild exported blocks in an empty cache whose pools are entirely free."""
    if cache.num_blocks:
        raise RuntimeError("a saved prefix cache loads only into an empty one")
    for name, alloc in cache.pools.items():
        if alloc.num_free != alloc.num_pages:
            raise RuntimeError(f"a saved prefix cache loads only over free pools; pool {name!r} has pages in use")
    built: list[Block] = []
    entries = set()
    for i, d in enumerate(data):
        parent = built[d["parent"]] if d["parent"] >= 0 else None
        root = bytes.fromhex(d["root"])
        digest = cache.digest(parent.digest if parent is not None else root, d["tokens"])
        if digest.hex() != d["digest"] or (parent is not None and parent.end != d["start"]):
            raise ValueError(f"saved prefix cache block {i} does not match its tokens (corrupted file)")
        pages = {name: d["pages"].get(name) for name in cache.spans}
        for name, page in pages.items():
            if page is None:
                continue
            alloc = cache.pools[name]
            if not 0 <= page < alloc.num_pages:
                raise ValueError(f"saved prefix cache block {i}: page {page} is outside pool {name!r}")
            if alloc._refs[page]:
                alloc.share(page)
            else:
                alloc.claim(page)
            cache._holds[name][page] = cache._holds[name].get(page, 0) + 1
        blk = Block(digest, parent, tuple(d["tokens"]), d["start"], pages, last_used=d["last_used"], root=root)
        snap = d["snapshot"]
        if snap is not None:
            if snap in entries or snap not in cache._snap_free:
                raise ValueError(f"saved prefix cache block {i}: snapshot entry {snap} is not available")
            entries.add(snap)
            cache._snap_free.remove(snap)
            cache._snap_owner[snap] = blk
            blk.snapshot = snap
        cache._blocks[digest] = blk
        cache._children(parent, root)[digest] = blk
        built.append(blk)
    for blk in built:
        cache._maybe_evictable(blk)
    cache._tick = itertools.count(max((b.last_used for b in built), default=0) + 1)
