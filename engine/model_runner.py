"""The per-device step runner: it queues one scheduled step on the device (`launch`) — the flattened batch and the
rows of the page tables that grew, forward (a decode graph's replay when one fits), logits, sampling — without
waiting for the device (see llm_engine.py), on what boot made (engine/boot.py). It is the unit a second GPU
replicates.

The MoE layers count the routed experts they read, per step kind (`ExpertCounts`, for /metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.state import ForwardBatch, SequenceState
from engine.sampler import sample
from engine.scheduler import ScheduledWork
from engine.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from engine.boot import Booted


class ExpertCounts:
    """Per step kind (decode: one token per request; prefill: any step with prompt tokens) and MoE layer: the steps
    run, and the distinct routed experts the layer's tokens picked, summed over those steps (the expert weights a
    step reads). The MoE's counting sort adds them on the device, inside the decode graphs too (whose padding rows
    count as well: their experts are read); they are copied to the host only by `read`, so steps never wait."""

    KINDS = ("decode", "prefill")

    def __init__(self, moes: list, device: torch.device):
        self.moes = moes
        self.touched = torch.zeros(len(self.KINDS), len(moes), dtype=torch.int64, device=device)
        self.steps = [0] * len(self.KINDS)
        self._reader = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._kind: int | None = None
        self._point(0)  # the decode graphs keep the counters they are captured with

    def _point(self, kind: int) -> None:
        if kind != self._kind:
            for layer, moe in enumerate(self.moes):
                moe.touched = self.touched[kind, layer]
            self._kind = kind

    def count(self, decoding: bool) -> None:
        """A step of this kind is about to run (eagerly, or as a decode graph's replay)."""
        kind = 0 if decoding else 1
        self.steps[kind] += 1
        self._point(kind)

    def reset(self) -> None:
        self.touched.zero_()
        self.steps = [0] * len(self.KINDS)

    def read(self) -> dict[str, tuple[int, list[int]]]:
        """Per kind: (steps, experts touched per MoE layer). The device's counters are copied on a stream of their
        own, without waiting for the steps queued (the caller may be the server's event loop): exact when the engine
        is idle, and while it runs the steps counted may lead the experts counted by the steps in flight."""
        steps = list(self.steps)
        with torch.cuda.stream(self._reader):  # a no-op without one (CPU)
            touched = self.touched.cpu().tolist()
        return {kind: (steps[k], touched[k]) for k, kind in enumerate(self.KINDS)}


class ModelRunner:
    def __init__(self, booted: Booted):
        self.booted = booted
        self.device, self.model, self.graphs, self.kv = booted.device, booted.model, booted.graphs, booted.kv
        self.expert_counts = booted.expert_counts
        self.pin_memory = booted.pin_memory
        # Every slot's page table, on the device, zero past its pages; a step uploads only the entries added since
        # the last (the first self._uploaded[s] pages of slot s are there).
        self.page_tables = torch.zeros(booted.num_slots, booted.layout.pages_for(booted.context_length),
                                       dtype=torch.int32, device=self.device)  # fmt: skip
        self._uploaded = [0] * booted.num_slots

    def release(self, state: SequenceState) -> None:
        """A finished or preempted request's slot (the scheduler took it and its pages back): its page table row goes
        back to zeros (after the steps already queued have read it)."""
        self.page_tables[state.slot, : self._uploaded[state.slot]].zero_()
        self._uploaded[state.slot] = 0

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """One host-to-device copy that does not wait for the device (from pinned memory, which the caching host
        allocator keeps until the copy is done)."""
        tensor = torch.tensor(values, dtype=torch.long)
        if self.pin_memory:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @torch.inference_mode()
    def launch(self, work: list[ScheduledWork], previous: LaunchedStep | None) -> LaunchedStep:
        """Queue one step on the device: each scheduled request advances by its tokens, and those whose prompt is
        now complete sample their next token. Nothing here waits for the device: a request whose last token is
        still in flight (sampled by `previous`, not yet read) takes it from `previous`'s tokens on the device, and
        the batch's host data goes over in one copy: input ids, positions, slots, the rows of its page tables that
        grew since the last step (kept per slot on the device), and the rows to sample."""
        ids, positions, slots, lens, states = [], [], [], [], []
        src, dst = [], []  # rows of `previous`'s tokens -> rows of this step's input ids
        table_at, table_pages = [], []  # new entries of the page tables, as flat indices into self.page_tables
        last_rows, sampled = [], []
        width = self.page_tables.shape[1]
        for item in work:
            seq, n = item.seq, item.num_tokens
            if seq.state is None:  # new to its slot: the slot's window ring and compressor state start afresh
                seq.state = SequenceState(seq.slot)
                self.kv.reset_slot(seq.slot)
            state, start = seq.state, seq.num_computed
            if state.num_tokens != start:
                raise ValueError(f"request continues at position {start} but has processed {state.num_tokens} tokens")
            if seq.num_in_flight:  # one decode row: its token is the one `previous` sampled
                src.append(previous.rows[seq.request_id])
                dst.append(len(ids))
                ids.append(0)
            else:
                ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            pages, uploaded = seq.page_table.pages, self._uploaded[state.slot]
            if len(pages) > uploaded:
                table_at += range(state.slot * width + uploaded, state.slot * width + len(pages))
                table_pages += pages[uploaded:]
                self._uploaded[state.slot] = len(pages)
            slots.append(state.slot)
            lens.append(n)
            states.append(state)
            if item.completes_prompt:
                last_rows.append(len(ids) - 1)
                sampled.append(seq)
        parts = [ids, positions, slots, src, dst, table_at, table_pages, last_rows]
        data = self._to_device([v for part in parts for v in part]).split([len(part) for part in parts])
        input_ids, positions_d, slots_d, src_d, dst_d, table_at_d, table_pages_d, last_rows_d = data
        if table_at:
            self.page_tables.view(-1).index_copy_(0, table_at_d, table_pages_d.int())
        if src:
            input_ids.index_copy_(0, dst_d, previous.tokens.index_select(0, src_d))
        batch = ForwardBatch(input_ids, positions_d, states, lens)
        used = max(len(item.seq.page_table.pages) for item in work)
        batch.set_tables(self.page_tables[:, :used].index_select(0, slots_d), slots_d.int())
        self.expert_counts.count(batch.decoding)
        if self.graphs is not None and self.graphs.fits(batch):
            # A one-token chunk of a longer prompt also runs as a decode row; it does not sample.
            logits = self.graphs.replay(batch)
            if len(last_rows) < len(states):
                logits = logits.index_select(0, last_rows_d)
        else:
            streams = self.model.run_layers(batch)
            logits = self.model.logits(streams.index_select(0, last_rows_d)) if sampled else None
        self.model.advance(batch)
        for item in work:
            item.seq.num_computed += item.num_tokens
        for seq in sampled:
            seq.num_in_flight += 1
        if not sampled:
            return LaunchedStep([], results=[])
        if all(seq.params.greedy and seq.params.constraint is None and seq.params.logprobs is None for seq in sampled):
            # Plain greedy: the argmax stays on the device for the next step; the host reads M ids, not M x vocab.
            return LaunchedStep(sampled, tokens=logits.argmax(dim=-1), pin_memory=self.pin_memory)
        logits = logits.cpu()
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        for row, seq in enumerate(sampled):
            try:
                results.append(sample(logits[row], seq.params, seq.generator, seq.remaining_output))
            except Exception as error:  # its grammar or its numbers: this request fails alone (llm_engine.py)
                results.append(error)
        return LaunchedStep(sampled, results=results)

    def synchronize(self) -> None:
        """Wait for the device; a broken one (a sticky CUDA error) raises here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LaunchedStep:
    """A step queued on the device: the requests it samples a token for, in order, and those tokens. Tokens sampled on
    the host (seeds, temperature, logprobs, constraints) are known at once; greedy ones stay on the device
    (`tokens`, which the next step reads) until `results()` waits for this step alone."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor | None = None,
        results: list[tuple[int, TokenLogprob | None] | Exception] | None = None,
        pin_memory: bool = False,
    ):
        self.seqs, self.tokens, self._results = seqs, tokens, results
        self.rows = {seq.request_id: row for row, seq in enumerate(seqs)}
        self._host, self._done = tokens, None
        if tokens is not None and tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pin_memory)
            self._host.copy_(tokens, non_blocking=pin_memory)
            self._done = torch.cuda.Event()
            self._done.record()

    @property
    def on_device(self) -> bool:
        """Its tokens are still to be read: the host may queue the next step first."""
        return self._results is None

    def results(self) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """(token, logprob record) per request of `seqs`, or what failed its sampling; waits for this step's tokens,
        not for later steps."""
        if self._results is None:
            if self._done is not None:
                self._done.synchronize()
            self._results = [(token, None) for token in self._host.tolist()]
        return self._results
