"""The step runner, one per rank (GPU), on what boot made (engine/boot.py). The engine's main process (rank 0) turns
each scheduled step into a `StepPlan` per rank on the host — the flattened batch, the rows of the page tables that
grew, the slots to reset — sends the plans to the other ranks (engine/parallel.py) and runs its own; every rank's
`execute` queues its plan on its device — forward (a decode graph's replay when one fits), logits — without waiting
for the device (see llm_engine.py). Rank 0 samples. Over several ranks the model's collectives keep them in
lockstep, so every rank runs every step: with data-parallel attention a rank without requests runs a padding row,
and the plans agree on the decode graph or the MoE's padded rows (`_agree`).

The MoE layers count the routed experts they read, per step kind (`ExpertCounts`, for /metrics).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.distributed import gather_rows
from engine.model.state import ForwardBatch, SequenceState
from engine.sampler import sample
from engine.scheduler import ScheduledWork
from engine.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from engine.boot import Booted
    from engine.parallel import RankGroup


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


@dataclass
class StepPlan:
    """One rank's part of a step, as its device needs it: the host's numbers, made by rank 0."""

    ids: list[int] = field(default_factory=list)  # input ids; 0 where `dst` takes the last step's token
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # a request slot per request
    lens: list[int] = field(default_factory=list)  # tokens per request
    src: list[int] = field(default_factory=list)  # rows of the last step's sampled tokens (on the device) ...
    dst: list[int] = field(default_factory=list)  # ... -> rows of this step's input ids
    table_at: list[int] = field(default_factory=list)  # new page-table entries, flat indices into the page tables
    table_pages: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)  # the rows that sample
    width: int = 1  # page-table columns the step reads
    reset_slots: list[int] = field(default_factory=list)  # slots that start a request: ring and compressors afresh
    restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, slot): a cached prefix's state, first
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot): copied after the step
    # (row, slot, snapshot): copied by each layer after that row, where a request's chunk is split at a boundary
    snapshots_after: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[tuple[int, int]] = field(default_factory=list)  # (slot, entries) of page-table rows to zero
    sample: str = "none"  # "none", "device" (greedy: the argmax stays on the device) or "host" (logits to rank 0)
    # Agreed over the ranks (_agree): the decode graph every rank replays, or the rows they pad to for the MoE.
    graph_size: int | None = None
    moe_rows: int | None = None
    sampled_rows: int | None = None  # data-parallel: the sampled rows every rank pads to when gathered to rank 0

    @property
    def decoding(self) -> bool:
        return all(n == 1 for n in self.lens) and not self.snapshots_after


class _Planner:
    """Rank 0's host-side bookkeeping for one replica's device (all ranks, unless attention is data-parallel): how
    much of each slot's page table is on the device, the rows of its last step's sampled tokens, and the slots
    released since its last step."""

    def __init__(self, num_slots: int, width: int):
        self.width = width
        self.uploaded = [0] * num_slots
        self.released: list[tuple[int, int]] = []
        self.rows: dict[str, int] = {}  # request id -> row of the last step's sampled tokens

    def release(self, state: SequenceState) -> None:
        self.released.append((state.slot, self.uploaded[state.slot]))
        self.uploaded[state.slot] = 0

    def plan(self, work: list[ScheduledWork]) -> tuple[StepPlan, list[Sequence]]:
        """The plan of this replica's work, and the requests it samples for, in row order. Each request advances by
        its tokens on the host; one whose last token is still in flight takes it from the last step's tokens on the
        device."""
        plan, sampled = StepPlan(released=self.released), []
        self.released = []
        for item in work:
            seq, n = item.seq, item.num_tokens
            if seq.state is None:  # new to its slot: its ring and compressor states start afresh or as cached
                seq.state = SequenceState(seq.slot, seq.num_computed)
                if item.restore is None:
                    plan.reset_slots.append(seq.slot)
                else:
                    plan.restores.append((item.restore, seq.slot))
            if item.snapshot is not None:
                plan.snapshots.append((seq.slot, item.snapshot))
            state, start = seq.state, seq.num_computed
            if state.num_tokens != start:
                raise ValueError(f"request continues at position {start} but has processed {state.num_tokens} tokens")
            if seq.num_in_flight:  # one decode row: its token is the one the last step sampled
                plan.src.append(self.rows[seq.request_id])
                plan.dst.append(len(plan.ids))
                plan.ids.append(0)
            else:
                plan.ids += seq.token_ids(start, start + n)
            plan.positions += range(start, start + n)
            pages, uploaded = seq.page_table.pages, self.uploaded[state.slot]
            if len(pages) > uploaded:
                plan.table_at += range(state.slot * self.width + uploaded, state.slot * self.width + len(pages))
                plan.table_pages += pages[uploaded:]
                self.uploaded[state.slot] = len(pages)
            splits = sorted(item.splits)
            cuts = [start, *(at for at, _ in splits), start + n]
            for row, (_, snapshot) in enumerate(splits, start=len(plan.lens)):
                plan.snapshots_after.append((row, state.slot, snapshot))
            plan.slots += [state.slot] * (len(cuts) - 1)
            plan.lens += [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
            plan.width = max(plan.width, len(pages))
            if item.completes_prompt:
                plan.last_rows.append(len(plan.ids) - 1)
                sampled.append(seq)
        for item in work:
            item.seq.state.num_tokens += item.num_tokens
            item.seq.num_computed += item.num_tokens
        for seq in sampled:
            seq.num_in_flight += 1
        self.rows = {seq.request_id: row for row, seq in enumerate(sampled)}
        if sampled:
            greedy = all(s.params.greedy and s.params.constraint is None and s.params.logprobs is None for s in sampled)
            plan.sample = "device" if greedy else "host"
        return plan, sampled


class ModelRunner:
    """`ranks`: the group this rank belongs to (None: one rank). On rank 0, `replicas` planners: one per
    data-parallel rank, else one for all."""

    def __init__(self, booted: Booted, ranks: RankGroup | None = None):
        self.booted, self.ranks = booted, ranks
        self.device, self.model, self.graphs, self.kv = booted.device, booted.model, booted.graphs, booted.kv
        self.expert_counts = booted.expert_counts
        self.pin_memory = booted.pin_memory
        self.data_parallel = booted.parallel.data_parallel
        self.rank = ranks.rank if ranks is not None else 0
        # Every slot's page table, on the device, zero past its pages; a step uploads only the entries added since
        # the last (the planner knows how many of slot s's are there).
        width = booted.layout.pages_for(booted.context_length)
        self.page_tables = torch.zeros(booted.num_slots, width, dtype=torch.int32, device=self.device)
        self.pad_slot = booted.config.max_num_seqs  # the graphs' and idle ranks' padding rows (when the cache has one)
        self.tokens: torch.Tensor | None = None  # the last step's greedy tokens, on the device
        replicas = ranks.size if ranks is not None and self.data_parallel else 1
        self.planners = [_Planner(booted.num_slots, width) for _ in range(replicas)]

    def release(self, state: SequenceState, replica: int = 0) -> None:
        """A finished or preempted request's slot (the scheduler took it and its pages back): its page table row goes
        back to zeros before the replica's next step."""
        self.planners[replica].release(state)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """One host-to-device copy that does not wait for the device (from pinned memory, which the caching host
        allocator keeps until the copy is done)."""
        tensor = torch.tensor(values, dtype=torch.long)
        if self.pin_memory:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def launch(self, work: list[ScheduledWork], previous: LaunchedStep | None) -> LaunchedStep:
        """Rank 0: queue one step on every rank's device. Each scheduled request advances by its tokens, and those
        whose prompt is now complete sample their next token. Nothing here waits for a device: a request whose last
        token is still in flight (sampled by `previous`, not yet read) takes it from the last step's tokens on the
        device. Tokens sampled on the host are known at once; greedy ones stay on the device until read."""
        by_replica: list[list[ScheduledWork]] = [[] for _ in self.planners]
        for item in work:
            by_replica[item.seq.replica].append(item)
        plans, sampled = zip(*(p.plan(w) for p, w in zip(self.planners, by_replica, strict=True)), strict=True)
        self._agree(plans)
        if self.ranks is not None:
            self.ranks.send(plans)
        logits, tokens = self.execute(plans[0])
        seqs = [seq for group in sampled for seq in group]
        if plans[0].sample == "none":
            return LaunchedStep([], results=[])
        if len(plans) > 1:  # gathered from every data-parallel rank, padded: each replica's own rows
            rows = self._to_device(
                [r * plans[0].sampled_rows + i for r, g in enumerate(sampled) for i in range(len(g))]
            )
            logits = logits.index_select(0, rows) if logits is not None else None
            tokens = tokens.index_select(0, rows) if tokens is not None else None
        if tokens is not None:
            return LaunchedStep(seqs, tokens=tokens, pin_memory=self.pin_memory)
        logits = logits.cpu()
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                results.append(sample(logits[row], seq.params, seq.generator, seq.remaining_output))
            except Exception as error:  # its grammar or its numbers: this request fails alone (llm_engine.py)
                results.append(error)
        return LaunchedStep(seqs, results=results)

    def _agree(self, plans: tuple[StepPlan, ...]) -> None:
        """What every rank's plan must share: how the step samples, and the decode graph all ranks replay (one
        that holds every replica's batch) or, eager, the rows the MoE pads each rank's tokens to."""
        kinds = {plan.sample for plan in plans} - {"none"}
        sample = "host" if "host" in kinds else kinds.pop() if kinds else "none"
        batch = max(len(plan.lens) or 1 for plan in plans)
        graph_size = None
        if self.graphs is not None and all(plan.decoding for plan in plans) and batch <= self.graphs.sizes[-1]:
            graph_size = next(size for size in self.graphs.sizes if size >= batch)
        for plan in plans:
            plan.sample, plan.graph_size = sample, graph_size
            if len(plans) > 1:
                plan.moe_rows = graph_size or max(len(p.ids) or 1 for p in plans)
                plan.sampled_rows = max(len(p.last_rows) for p in plans) or 1

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Queue this rank's plan: the batch's host data in one copy (input ids, positions, slots, the page-table
        entries added, the rows to sample), forward, the logits of the sampled rows and, greedy, their argmax (kept
        for the next step). Data-parallel: both gathered from every rank (to rank 0). A rank without requests runs
        one padding row. Returns (logits or None, greedy tokens or None)."""
        for slot, entries in plan.released:
            self.page_tables[slot, :entries].zero_()
        for slot in plan.reset_slots:
            self.kv.reset_slot(slot)
        ids, positions, slots, lens = plan.ids, plan.positions, plan.slots, plan.lens
        if not lens:  # an idle data-parallel rank: one row at position 0 of the padding slot touches no page
            ids, positions, slots, lens = [0], [0], [self.pad_slot], [1]
        copies = [[pair[i] for pair in pairs] for pairs in (plan.restores, plan.snapshots) for i in (0, 1)]
        copies += [[after[i] for after in plan.snapshots_after] for i in (1, 2)]
        parts = [ids, positions, slots, plan.src, plan.dst, plan.table_at, plan.table_pages, plan.last_rows, *copies]
        data = self._to_device([v for part in parts for v in part]).split([len(part) for part in parts])
        input_ids, positions_d, slots_d, src_d, dst_d, table_at_d, table_pages_d, last_rows_d, *copies_d = data
        if plan.restores:
            self.kv.copy_slots(copies_d[0], copies_d[1])
        if plan.table_at:
            self.page_tables.view(-1).index_copy_(0, table_at_d, table_pages_d.int())
        if plan.src:
            input_ids.index_copy_(0, dst_d, self.tokens.index_select(0, src_d))
        firsts = itertools.accumulate(lens[:-1], initial=0)  # each row's first position, on the host
        states = [SequenceState(slot, positions[first]) for slot, first in zip(slots, firsts, strict=True)]
        batch = ForwardBatch(input_ids, positions_d, states, lens)
        for k, (row, _, _) in enumerate(plan.snapshots_after):
            batch.snapshots_after[row] = (copies_d[4][k : k + 1], copies_d[5][k : k + 1])
        batch.set_tables(self.page_tables[:, : plan.width].index_select(0, slots_d), slots_d.int())
        batch.moe_rows = plan.moe_rows
        self.expert_counts.count(batch.decoding)
        sampling = plan.sample != "none"
        if plan.graph_size is not None:
            # A one-token chunk of a longer prompt also runs as a decode row; it does not sample.
            logits = self.graphs.replay(batch, plan.graph_size)
            if len(plan.last_rows) < len(lens):
                logits = logits.index_select(0, last_rows_d)
        else:
            streams = self.model.run_layers(batch)
            logits = self.model.logits(streams.index_select(0, last_rows_d)) if sampling else None
        if plan.snapshots:
            self.kv.copy_slots(copies_d[2], copies_d[3])
        if not sampling:
            return None, None
        tokens = None
        if plan.sample == "device":
            tokens = self.tokens = logits.argmax(dim=-1)
        if plan.sampled_rows is not None:  # data-parallel: every rank's rows, padded, to rank 0
            if tokens is not None:
                return None, gather_rows(tokens, plan.sampled_rows)
            return gather_rows(logits, plan.sampled_rows), None
        return (None if tokens is not None else logits), tokens

    def serve(self) -> None:
        """A rank other than 0: run the plans rank 0 sends, until it sends none."""
        while (plans := self.ranks.receive()) is not None:
            self.execute(plans[self.rank if self.data_parallel else 0])

    def synchronize(self) -> None:
        """Wait for the device; a broken one (a sticky CUDA error) raises here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LaunchedStep:
    """A step queued on the device: the requests it samples a token for, in order, and those tokens. Tokens sampled on
    the host (seeds, temperature, logprobs, constraints) are known at once; greedy ones stay on the device until
    `results()` waits for this step alone."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor | None = None,
        results: list[tuple[int, TokenLogprob | None] | Exception] | None = None,
        pin_memory: bool = False,
    ):
        self.seqs, self.tokens, self._results = seqs, tokens, results
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
