"""Which requests run in the next step, how many of their tokens, and which KV pages they hold.

Three limits shape a step: `max_num_seqs` requests run at once; `max_num_batched_tokens` tokens run per step, one
for every decoding request first, then prefill chunks in arrival order; and the page pool, where every running
request holds the pages of the tokens it has processed. The scheduler owns the block manager
(engine/cache/block_manager.py): it alone hands out and takes back pages and request slots. A waiting request is
admitted only when the pages of its whole remaining prompt are free beside those the running requests still need for
theirs, so admission never pushes out a running request. When a running request needs a
page and none is free, the youngest running request is preempted by recompute: its pages and model state are
dropped and it goes back to the front of the waiting queue, keeping its output; on re-admission its prompt and
output are prefilled again and it goes on exactly where it was. The oldest request therefore always progresses: the
engine caps every request at the pool's capacity, so one request alone always fits.

The engine schedules a step while the previous one still runs on the device (llm_engine.py): a request whose token
in flight is its last (`Sequence.out_of_budget`) leaves `running` and gives its pages back at once, as it would have
finished before this step without the overlap; a preempted request whose token is in flight waits for it before it
is re-admitted (its prefill needs every token on the host).

With prefix caching (engine/cache/block_manager.py) a request is admitted with the longest cached prefix of its
tokens: it shares that prefix's pages, its slot gets the prefix's snapshot (`ScheduledWork.restore`), and it
prefills only the rest. A prompt's prefill takes a snapshot of the slot at the prompt's last page boundary (and at
the common prefix of requests waiting for it), registered as a cached prefix once the step is queued (a later step
may restore it): copied after the step when a chunk ends there (`ScheduledWork.snapshot`), else the chunk runs as
consecutive rows of one batch, split there, and each layer copies the slot between them (`ScheduledWork.splits`) —
one step still, so the tokens after the boundary do not cost another read of every weight; a decode step that
completes a page copies the slot into the request's one output snapshot, registered when the request leaves
(finished, aborted or preempted), when its tokens are all on the host.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.block_manager import BlockManager, prefix_keys
from engine.config import EngineConfig
from engine.model.state import SequenceState
from engine.sequence import Sequence, Status


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int
    restore: int | None = None  # the snapshot slot the request's slot starts from (a cached prefix's)
    snapshot: int | None = None  # the snapshot slot its slot is copied into after this step
    # (position, snapshot slot): boundaries inside the chunk, where the chunk runs as consecutive rows of one batch
    # and each layer copies the slot into the snapshot between them
    splits: list[tuple[int, int]] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """After this step the model has seen every token of the request, so it samples the next one."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, release: Callable[[SequenceState], None]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.blocks = blocks
        self.release = release  # tells the device side that a request's model state (its slot's tables) is gone
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.num_preemptions = 0
        self._to_register: list[tuple[bytes, int, list[int], int]] = []  # prompt snapshots taken by this step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledWork]:
        work: list[ScheduledWork] = []
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.out_of_budget:
                # Its token in flight is its last: it runs no more, and its pages and slot go back now (the device
                # finishes the step in flight before any later step reuses them). The engine finishes it on reading.
                self.running.pop(i)
                self._drop_state(seq)
                continue
            # A prefill chunk leaves room for the decode tokens of the requests behind it, which come first.
            decodes_behind = (
                0 if seq.decoding else sum(s.decoding and not s.out_of_budget for s in self.running[i + 1 :])
            )
            n = min(seq.num_pending, budget - decodes_behind)
            if n > 0:
                if not self._hold_pages(seq, seq.num_computed + n):
                    break  # it was the youngest and went back to waiting; nobody runs behind it
                work.append(self._work(seq, n))
                budget -= n
            i += 1
        # Pages the running requests still need for the tokens they have (prompts prefilled in chunks): admission
        # leaves them free, so it never pushes out a running request.
        page = self.blocks.page_size
        pending = sum(seq.page_table.pages_needed(seq.num_tokens, page) for seq in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_in_flight:  # preempted with a token in flight: re-admitted once it is read
                break
            keys = self._keys(seq)
            cached = self.blocks.lookup(keys)
            reused = cached.pages if cached is not None else ()
            needed = seq.page_table.pages_needed(seq.num_tokens, page) - len(reused)
            fits = budget > 0 and needed <= self.blocks.free_if_shared(reused) - pending
            # Checked also when it cannot run yet (the step's tokens spent by a long prefill): a running prompt it
            # shares more with than the cache holds snapshots there while it computes, so that prefix runs once.
            if self._wait_for_shared_prefix(keys, len(reused) * self.blocks.page_size, work) or not fits:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            seq.slot = self.blocks.take_slot()  # one is free: at most max_num_seqs run
            restore = None
            if cached is not None:
                self.blocks.share(cached.pages)
                seq.page_table.pages = list(cached.pages)
                seq.num_computed, restore = cached.tokens, cached.snapshot
            if seq.cached_tokens is None:  # the first admission's reuse is the request's
                seq.cached_tokens = seq.num_computed
                self.blocks.queried_tokens += len(seq.prompt_ids)
                self.blocks.hit_tokens += seq.num_computed
            n = min(seq.num_pending, budget)
            seq.page_table.grow(self.blocks, seq.num_computed + n)
            pending += seq.page_table.pages_needed(seq.num_tokens, page)
            work.append(self._work(seq, n, restore))
            budget -= n
        for key, tokens, pages, snapshot in self._to_register:
            self.blocks.register(key, tokens, pages, snapshot)
        self._to_register = []
        return work

    def _keys(self, seq: Sequence) -> list[bytes]:
        """The prefix-cache keys of the request's tokens at each page boundary that leaves one to compute."""
        if seq.num_tokens > len(seq.prompt_ids) and self.blocks.caching:
            return prefix_keys(seq.token_ids(0, seq.num_tokens), self.blocks.page_size, seq.num_tokens - 1,
                               self.prompt_keys(seq))  # fmt: skip
        return self.prompt_keys(seq)

    def prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Those of its prompt, made once."""
        if not self.blocks.caching:
            return []
        if seq.prompt_keys is None:
            seq.prompt_keys = prefix_keys(seq.prompt_ids, self.blocks.page_size, len(seq.prompt_ids) - 1)
        return seq.prompt_keys

    def _wait_for_shared_prefix(self, keys: list[bytes], cached: int, work: list[ScheduledWork]) -> bool:
        """Requests that arrive together with a common prefix compute it once: when a running request has not yet
        computed past a longer common prefix (whole pages) than the cache holds, it takes a snapshot there (this
        step's chunk shortened to end there if it would run past) and the new request waits for it."""
        page = self.blocks.page_size
        scheduled = {item.seq.request_id: item for item in work}
        for other in self.running:
            other_keys = self.prompt_keys(other)
            common = next((j for j, (a, b) in enumerate(zip(keys, other_keys, strict=False)) if a != b),
                          min(len(keys), len(other_keys)))  # fmt: skip
            shared = common * page
            if shared <= cached or other.num_computed >= shared:
                continue
            if shared not in self._boundaries(other):
                other.prompt_boundaries.add(shared)
                item = scheduled.get(other.request_id)
                if item is not None and other.num_computed + item.num_tokens >= shared:  # this step passes it
                    self._prompt_snapshot(item, shared)
            return True
        return False

    def _boundaries(self, seq: Sequence) -> set[int]:
        """Where its prompt's prefill takes snapshots: the prompt's last page boundary that leaves a token to
        compute, and the common prefixes of requests waiting for it; none without prefix caching."""
        if not self.blocks.caching:
            return set()
        return seq.prompt_boundaries | {(len(seq.prompt_ids) - 1) // self.blocks.page_size * self.blocks.page_size}

    def _prompt_snapshot(self, work: ScheduledWork, at: int) -> None:
        """`work` reaches `at`, a snapshot boundary of its prompt: its slot there is copied into a snapshot slot —
        after the step when its chunk ends there, else between the rows its chunk runs as — registered once the step
        is queued."""
        snapshot = self.blocks.take_snapshot()
        if snapshot is None:
            return
        if work.seq.num_computed + work.num_tokens == at:
            work.snapshot = snapshot
        else:
            work.splits.append((at, snapshot))
        key = self.prompt_keys(work.seq)[at // self.blocks.page_size - 1]
        self._to_register.append((key, at, work.seq.page_table.pages, snapshot))

    def _work(self, seq: Sequence, n: int, restore: int | None = None) -> ScheduledWork:
        """The step's work for `seq`, with the snapshots it takes at the cacheable page boundaries it reaches."""
        work = ScheduledWork(seq, n, restore)
        start, end = seq.num_computed, seq.num_computed + n
        if not self.blocks.caching:
            return work
        boundaries = self._boundaries(seq)
        for at in sorted(b for b in boundaries if start < b <= end):
            self._prompt_snapshot(work, at)
        if end % self.blocks.page_size or end == 0 or end in boundaries:
            return work
        if end >= len(seq.prompt_ids):  # the prompt's end, or a page of output: the request's one output snapshot
            if seq.output_snapshot is None:
                seq.output_snapshot = self.blocks.take_snapshot()
            if seq.output_snapshot is not None:
                work.snapshot, seq.output_snapshot_tokens = seq.output_snapshot, end
        return work

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_state(seq)  # the request's KV is released at once

    def _hold_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the pages for `num_tokens`, preempting the youngest running requests while the pool is short;
        False when `seq` itself had to go."""
        while seq.page_table.pages_needed(num_tokens, self.blocks.page_size) > self.blocks.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.page_table.grow(self.blocks, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_state(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop_state(self, seq: Sequence) -> None:
        if seq.state is not None:
            self.release(seq.state)
            seq.state = None
        if seq.output_snapshot is not None:  # its tokens up to the snapshot are all on the host now
            end = seq.output_snapshot_tokens
            if end and end <= len(seq.prompt_ids) + len(seq.output_ids):
                key = prefix_keys(seq.token_ids(0, end), self.blocks.page_size, end, self.prompt_keys(seq))[-1]
                self.blocks.register(key, end, seq.page_table.pages, seq.output_snapshot)
            else:
                self.blocks.release_snapshot(seq.output_snapshot)
            seq.output_snapshot, seq.output_snapshot_tokens = None, 0
        seq.page_table.release(self.blocks)
        if seq.slot is not None:
            self.blocks.free_slot(seq.slot)
            seq.slot = None
