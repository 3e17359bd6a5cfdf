"""The fixed-size page pool: every request's compressed KV lives in pages handed out here, and capacity in tokens is
counted from what was allocated (pages x page_size), never estimated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPages(RuntimeError):
    """The pool cannot hand out the pages asked for; the scheduler preempts or waits."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first

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


@dataclass
class PageTable:
    """One request's pages, in order: raw token t lives in page pages[t // page_size]."""

    pages: list[int] = field(default_factory=list)

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        return max(0, -(-num_tokens // page_size) - len(self.pages))

    def grow(self, pool: PagePool, num_tokens: int) -> None:
        """Hold enough pages for `num_tokens` tokens (raises OutOfPages, holding what it had)."""
        self.pages.extend(pool.allocate(self.pages_needed(num_tokens, pool.page_size)))

    def release(self, pool: PagePool) -> None:
        pool.free(self.pages)
        self.pages = []

    def slots(self, start: int, end: int, rows_per_page: int, device=None) -> torch.Tensor:
        """Physical slots of rows [start, end) of a kind that keeps `rows_per_page` rows a page (64 c4 rows, 2 c128
        rows): row r lives in page pages[r // rows_per_page]."""
        rows = torch.arange(start, end, device=device)
        pages = torch.tensor(self.pages, dtype=torch.long, device=device)
        return pages[rows // rows_per_page] * rows_per_page + rows % rows_per_page
