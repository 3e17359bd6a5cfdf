"""The one place KV memory is handed out, owned by the scheduler: the pool's fixed-size pages, where every request's
compressed KV lives (capacity in tokens is counted from what was allocated, pages x page_size, never estimated), and
the request slots, each a window ring and compressor state in every layer for one running request. The storage
itself is allocated at boot (engine/cache/kv_cache.py); the model only reads the tables a step hands it."""

from __future__ import annotations

from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The pool cannot hand out the pages asked for; the scheduler preempts or waits."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_size, self.num_slots = num_pages, page_size, num_slots
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self._free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - self.num_free) * self.page_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages asked, {len(self._free)} free of {self.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def take_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} request slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)


@dataclass
class PageTable:
    """One request's pages, in order: raw token t lives in page pages[t // page_size]."""

    pages: list[int] = field(default_factory=list)

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        return max(0, -(-num_tokens // page_size) - len(self.pages))

    def grow(self, blocks: BlockManager, num_tokens: int) -> None:
        """Hold enough pages for `num_tokens` tokens (raises OutOfPages, holding what it had)."""
        self.pages.extend(blocks.allocate(self.pages_needed(num_tokens, blocks.page_size)))

    def release(self, blocks: BlockManager) -> None:
        blocks.free(self.pages)
        self.pages = []
