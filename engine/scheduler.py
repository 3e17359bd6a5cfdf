"""Which requests run in the next step, and how many of their tokens.

Decode first (one token for every running request whose prompt is done), then prefill chunks within the step's
token budget (`max_num_batched_tokens`), admitting waiting requests while fewer than `max_num_seqs` run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
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
    def __init__(self, config: EngineConfig):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledWork]:
        budget = self.max_num_batched_tokens
        work = []
        decoding = [s for s in self.running if s.num_pending == 1 and s.num_computed >= len(s.prompt_ids)]
        for seq in decoding[:budget]:
            work.append(ScheduledWork(seq, 1))
        budget -= len(work)
        prefilling = [s for s in self.running if s not in decoding]
        for seq in prefilling:
            if budget == 0:
                break
            n = min(seq.num_pending, budget)
            work.append(ScheduledWork(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_pending, budget)
            work.append(ScheduledWork(seq, n))
            budget -= n
        return work

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        seq.state = None  # the request's KV state is released at once
