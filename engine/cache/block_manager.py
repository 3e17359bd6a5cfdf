"""The one place KV memory is handed out, owned by the scheduler: the pool's fixed-size pages, where every request's
compressed KV lives (capacity in tokens is counted from what was allocated, pages x page_size, never estimated), and
the request slots, each a window ring and compressor state in every layer for one running request. The storage
itself is allocated at boot (engine/cache/kv_cache.py); the model only reads the tables a step hands it.

Prefix caching. A page holds the compressed rows of 256 raw tokens, and once a request has run past it those rows
never change: they depend only on the tokens it holds and every token before it. So a finished page can be shared,
read-only, by any later request whose tokens begin the same way (a page is counted by its holders: requests' page
tables and cached prefixes). But a request's state is more than its pages: the sliding-window ring and the
compressors' unfinished windows live in its slot, and each layer's window depends on the layer below over many more
tokens, so they cannot be recomputed from a window's worth of tokens. A `CachedPrefix` is therefore a page boundary
with its pages and a *snapshot*: a spare slot holding a copy of the request's slot state at that boundary. A request
that begins with a cached prefix takes its pages, has the snapshot copied into its own slot, and prefills only what
follows — exactly the state it would have computed. Snapshots are taken at the last page boundary of a prompt (the
next turn of a conversation re-sends it) and at the latest page boundary a request's output reaches (the next turn
also re-sends the answer). Cached prefixes no request holds stay until their room is needed, least recently used
first; their pages count as free. Keys are chained digests (blake2b) of the tokens, so no prompt can be crafted to
read another's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The pool cannot hand out the pages asked for; the scheduler preempts or waits."""


@dataclass(frozen=True)
class CachedPrefix:
    """The first `tokens` tokens of some earlier request (a multiple of the page size): their pages, in order, and
    the slot holding the request's window ring and compressor states right after them."""

    key: bytes
    tokens: int
    pages: tuple[int, ...]
    snapshot: int


def prefix_keys(tokens: list[int], page_size: int, upto: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The key of every page boundary b <= upto of `tokens`: a digest of tokens[:b], chained page by page. `known`:
    the keys of its first pages, made already (its prompt's), where the chain goes on from."""
    keys = list(known[: upto // page_size])
    key = keys[-1] if keys else b""
    for start in range(len(keys) * page_size, upto - page_size + 1, page_size):
        key = hashlib.blake2b(key + array("q", tokens[start : start + page_size]).tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, snapshot_slots: range = range(0)):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_size, self.num_slots = num_pages, page_size, num_slots
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._holders = [0] * num_pages  # page tables and cached prefixes holding each page
        self._cached = [0] * num_pages  # ... of which cached prefixes
        self._evictable = 0  # pages only cached prefixes hold
        self.cached_pages = 0  # pages some cached prefix holds
        # Prefix caching is on when there are snapshot slots (slots of the cache beyond the requests' own).
        self.prefixes: OrderedDict[bytes, CachedPrefix] = OrderedDict()  # least recently used first
        self._free_snapshots = list(reversed(snapshot_slots))
        self.caching = len(snapshot_slots) > 0
        self.queried_tokens = self.hit_tokens = 0  # prompt tokens looked up, and found, since boot

    @property
    def num_free(self) -> int:
        """Pages a request can have now: free ones and those only cached prefixes hold."""
        return len(self._free) + self._evictable

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - self.num_free) * self.page_size

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"{n} pages asked, {self.num_free} free of {self.num_pages}")
        while len(self._free) < n:
            self._evict_oldest()
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._holders[page] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """A page table lets its pages go: each goes back once nothing holds it."""
        for page in reversed(pages):
            self._hold(page, -1, 0)

    def free_if_shared(self, pages: tuple[int, ...]) -> int:
        """num_free once a page table shares `pages` (those only cached prefixes held are no longer free)."""
        return self.num_free - sum(1 for page in pages if self._holders[page] == self._cached[page] > 0)

    def share(self, pages: tuple[int, ...]) -> None:
        """A page table takes pages a cached prefix holds."""
        for page in pages:
            self._hold(page, 1, 0)

    def _hold(self, page: int, holders: int, cached: int) -> None:
        was, was_cached = self._holders[page] == self._cached[page] > 0, self._cached[page] > 0
        self._holders[page] += holders
        self._cached[page] += cached
        now = self._holders[page] == self._cached[page] > 0
        self._evictable += now - was
        self.cached_pages += (self._cached[page] > 0) - was_cached
        if self._holders[page] == 0:
            self._free.append(page)

    def take_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} request slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    # Cached prefixes.

    def lookup(self, keys: list[bytes]) -> CachedPrefix | None:
        """The longest cached prefix among `keys` (prefix_keys of a request's tokens up to one before its last: its
        logits sample the next), now the most recently used; None when nothing matches."""
        for key in reversed(keys):
            if (found := self.prefixes.get(key)) is not None:
                self.prefixes.move_to_end(key)
                return found
        return None

    def cached_tokens(self, keys: list[bytes]) -> int:
        """How many tokens `lookup` would find, without touching the order of eviction."""
        return next((self.prefixes[key].tokens for key in reversed(keys) if key in self.prefixes), 0)

    def take_snapshot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used prefix when none is; None when every slot holds
        a snapshot some request has not registered yet."""
        if not self._free_snapshots and self.prefixes:
            self._evict_oldest()
        return self._free_snapshots.pop() if self._free_snapshots else None

    def release_snapshot(self, slot: int) -> None:
        self._free_snapshots.append(slot)

    def register(self, key: bytes, tokens: int, pages: list[int], snapshot: int) -> None:
        """The request whose first `tokens` tokens (a page multiple, `key` their prefix key) are in `pages`, its slot
        state at that boundary in `snapshot`: a cached prefix from the next step on (a prefix cached already keeps its
        own)."""
        if key in self.prefixes:
            self.release_snapshot(snapshot)
            self.prefixes.move_to_end(key)
            return
        held = tuple(pages[: tokens // self.page_size])
        for page in held:
            self._hold(page, 1, 1)
        self.prefixes[key] = CachedPrefix(key, tokens, held, snapshot)

    def _evict_oldest(self) -> None:
        _, prefix = self.prefixes.popitem(last=False)
        for page in prefix.pages:
            self._hold(page, -1, -1)
        self.release_snapshot(prefix.snapshot)


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
