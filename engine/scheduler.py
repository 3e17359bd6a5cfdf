"""Which requests run in the next step, how many of their tokens, and which KV pages they hold.

Three limits shape a step: `max_num_seqs` requests run at once; `max_num_batched_tokens` tokens run per step, one
for every decoding request first, then prefill chunks in arrival order; and the page pool, where every running
request holds the pages of the tokens it has processed. The scheduler owns the block manager
(engine/cache/block_manager.py): it alone hands out and takes back pages and request slots. A waiting request is
admitted only when the pages of its whole remaining prompt are free, so admission never pushes out a running
request. When a running request needs a
page and none is free, the youngest running request is preempted by recompute: its pages and model state are
dropped and it goes back to the front of the waiting queue, keeping its output; on re-admission its prompt and
output are prefilled again and it goes on exactly where it was. The oldest request therefore always progresses: the
engine caps every request at the pool's capacity, so one request alone always fits.

The engine schedules a step while the previous one still runs on the device (llm_engine.py): a request whose token
in flight is its last (`Sequence.out_of_budget`) leaves `running` and gives its pages back at once, as it would have
finished before this step without the overlap; a preempted request whose token is in flight waits for it before it
is re-admitted (its prefill needs every token on the host).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.cache.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model.state import SequenceState
from engine.sequence import Sequence, Status


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int

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
                work.append(ScheduledWork(seq, n))
                budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_in_flight:  # preempted with a token in flight: re-admitted once it is read
                break
            if seq.page_table.pages_needed(seq.num_tokens, self.blocks.page_size) > self.blocks.num_free:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            seq.slot = self.blocks.take_slot()  # one is free: at most max_num_seqs run
            n = min(seq.num_pending, budget)
            seq.page_table.grow(self.blocks, seq.num_computed + n)
            work.append(ScheduledWork(seq, n))
            budget -= n
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
        seq.page_table.release(self.blocks)
        if seq.slot is not None:
            self.blocks.free_slot(seq.slot)
            seq.slot = None
