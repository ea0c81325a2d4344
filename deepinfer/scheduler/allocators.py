"""Page and slot allocators for the device pools.

Pages hold compressed rows of a growing pool (a page of ``page_size`` rows);
reference counts let prefix sharing hand one page to several requests later.
Slots hold per-request fixed-size state (window ring, compressor token rings).
"""

from __future__ import annotations


class OutOfPages(Exception):
    pass


class PageAllocator:
    """Free list + reference counts over ``num_pages`` pages of one pool."""

    def __init__(self, name: str, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"pool {name!r} needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"pool {self.name!r}: {n} pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def claim(self, page: int) -> None:
        """Take one particular free page (restoring a saved prefix cache puts blocks back on their pages)."""
        if self._refs[page]:
            raise ValueError(f"pool {self.name!r}: page {page} is in use")
        self._free.remove(page)
        self._refs[page] = 1

    def share(self, page: int) -> None:
        """Another holder for a page in use (prefix sharing)."""
        if self._refs[page] < 1:
            raise ValueError(f"pool {self.name!r}: page {page} is not in use")
        self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"pool {self.name!r}: page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check_refs(self, expected: list[int]) -> None:
        """Invariant: each page's reference count is what its holders account for (requests and
        cache blocks), and the free list holds exactly the unreferenced pages, once each."""
        if self._refs != expected:
            bad = [(p, r, e) for p, (r, e) in enumerate(zip(self._refs, expected)) if r != e]
            raise AssertionError(f"pool {self.name!r}: (page, refs, holders) disagree: {bad[:10]}")
        free = [p for p, r in enumerate(self._refs) if r == 0]
        if sorted(self._free) != free:
            raise AssertionError(f"pool {self.name!r}: the free list {sorted(self._free)[:20]} is not the "
                                 f"unreferenced pages {free[:20]}")

    def check_all_free(self) -> None:
        """Invariant after a workload drains: every page back on the free list, exactly once."""
        if sorted(self._free) != list(range(self.num_pages)) or any(self._refs):
            used = [p for p, r in enumerate(self._refs) if r]
            raise AssertionError(f"pool {self.name!r}: pages still held: {used[:20]}")


class SlotAllocator:
    """Fixed number of per-request state slots."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_all_free(self) -> None:
        if self._used or sorted(self._free) != list(range(self.num_slots)):
            raise AssertionError(f"slots still held: {sorted(self._used)}")
