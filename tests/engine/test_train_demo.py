"""The demo model's training (engine/tools/train_demo.py) on the CPU at the tiny checkpoint's widths: every trainable
tensor gets a gradient (the indexer's through its distillation), a batch trained on is fitted, routing biases move
towards balance, the dense warm-up attends every c4 row, runs are seeded and go on from a checkpoint at their step of
the schedule, and what it writes is a checkpoint the engine serves and evaluation scores."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.model.attention import Attention
from engine.tools import demo_data
from engine.tools.make_tiny import TINY_CONFIG
from engine.tools.train_demo import (
    LOSSES,
    MAX_CHECKPOINT_BYTES,
    Example,
    Recipe,
    Replicas,
    _completion_span,
    _task_weights,
    balance_routing,
    batches,
    differentiable_kernels,
    evaluate,
    examples,
    initial_model,
    losses,
    routing_loads,
    train,
    train_step,
)

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
# The tiny widths (window 16, 8 top-k rows): the c4, c128 and indexer paths all matter within a 1-2K-token sample.
SMALL = Recipe(train_samples=7, eval_per_task=1, max_tokens=2048, row_tokens=2048, tokens_per_step=2500, steps=2,
               warmup_steps=1, dense_warmup_steps=0, config=dict(TINY_CONFIG))  # fmt: skip


@pytest.fixture(scope="module")
def items():
    samples = demo_data.generate("train", demo_data.mix_counts(7), demo_data.Config(max_tokens=2048))
    return examples(samples)


@pytest.fixture(autouse=True)
def references():
    with differentiable_kernels():
        yield


def test_every_trainable_tensor_gets_a_gradient_and_the_indexer_learns_from_the_attention(items):
    model = initial_model(SMALL, CPU)
    batch = next(batches(items, SMALL.tokens_per_step, SMALL.row_tokens, SMALL.seed))
    parts = losses(model, batch, CPU)
    assert parts["indexer"] > 0 and all(torch.isfinite(v) for v in parts.values())
    (parts["lm"] + parts["mtp"] + parts["indexer"]).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing
    # The indexer's own tensors learn only from its distillation: without it their gradient is zero.
    model.zero_grad(set_to_none=True)
    losses(model, batch, CPU)["lm"].backward()
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n and p.requires_grad]
    assert indexer and all(p.grad is None or not p.grad.any() for p in indexer)


def test_a_task_weight_counts_its_completion_tokens_that_many_times(items):
    """Retrieval weighted 3: the lm and MTP losses of two rows are their own losses' mean weighted by completion
    tokens, a retrieval token counted thrice; the prompt loss is not weighted. A weight names a task and is positive."""
    model = initial_model(SMALL, CPU)
    retrieval = next(e for e in items if e.needle is not None)
    other = next(e for e in items if e.needle is None)
    with torch.no_grad():
        alone = [losses(model, [(e,)], CPU) for e in (retrieval, other)]
        both = losses(model, [(dataclasses.replace(retrieval, weight=3.0),), (other,)], CPU)
    for name, ahead in (("lm", 1), ("mtp", 2)):
        counts = [_completion_span(e, ahead)[1] for e in (retrieval, other)]
        expected = (3 * counts[0] * alone[0][name] + counts[1] * alone[1][name]) / (3 * counts[0] + counts[1])
        assert both[name].item() == pytest.approx(expected.item(), rel=1e-4)
    counts = [e.prompt_len - 1 for e in (retrieval, other)]
    expected = (counts[0] * alone[0]["prompt"] + counts[1] * alone[1]["prompt"]) / sum(counts)
    assert both["prompt"].item() == pytest.approx(expected.item(), rel=1e-4)
    assert _task_weights("retrieval=4,json=1.5") == {"retrieval": 4.0, "json": 1.5}
    for wrong in ("retreival=4", "json=0", "json"):
        with pytest.raises(argparse.ArgumentTypeError):
            _task_weights(wrong)
    with pytest.raises(ValueError, match="task_weights"):
        Recipe(task_weights={"json": -1.0})


class HostReads(TorchFunctionMode):
    """Counts, by the engine function that made them, the ops that read a tensor's values back to the host: on a GPU
    each waits until every kernel queued before it has run, and the host queues nothing meanwhile."""

    READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero", "masked_select", "unique",
             "bincount"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.by_function: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        by_mask = name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in self.READS or by_mask:
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}engine{os.sep}" not in frame.f_code.co_filename:
                frame = frame.f_back
            self.by_function[frame.f_code.co_name if frame else "?"] += 1
        return func(*args, **(kwargs or {}))


def test_a_training_forward_reads_the_device_a_layer_at_most_not_a_row(items):
    """A step of eight rows on the GPU waited some 64 times more than one of one row (each c4 layer's select and
    distillation, each c128 block). What may grow with the rows: the targets, made from each sample's ids, which the
    trainer holds on the host."""
    model = initial_model(SMALL, CPU)
    rows = [(e,) for e in items[:3]]

    def reads(n: int) -> Counter[str]:
        with HostReads() as mode:
            losses(model, rows[:n], CPU)
        return mode.by_function

    one, three = reads(1), reads(3)
    assert one  # the counter sees the MoE reference's read of its experts' loads
    grows = {function for function, count in three.items() if count > one[function]}
    assert grows <= {"_target", "_prompt_target"}, {f: (one[f], three[f]) for f in grows}


def test_a_batch_trained_on_is_fitted_and_routing_biases_move_towards_balance(items):
    model = initial_model(SMALL, CPU)
    batch = next(batches(items, SMALL.tokens_per_step, SMALL.row_tokens, SMALL.seed))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    first = None
    for _ in range(8):
        with routing_loads(model) as loads:
            parts = losses(model, batch, CPU)
        first = first if first is not None else parts["lm"].item()
        optimizer.zero_grad()
        (parts["lm"] + parts["mtp"] + parts["indexer"]).backward()
        optimizer.step()
    assert parts["lm"].item() < 0.5 * first
    gate, load = next(iter(loads.items()))
    before = gate.bias.detach().clone()
    balance_routing({gate: load}, SMALL.bias_update)
    moved = gate.bias - before
    assert ((moved > 0) == (load < load.mean())).all() and ((moved < 0) == (load > load.mean())).all()


def test_training_is_seeded_and_writes_a_checkpoint_the_engine_serves(tmp_path):
    for run, replicas in (("a", 1), ("b", 1), ("c", 2)):
        train(SMALL, tmp_path / run, CPU, replicas=replicas)
    curves = [json.loads((tmp_path / d / "train_log.json").read_text())["curve"] for d in "abc"]
    assert [c["lm"] for c in curves[0]] == [c["lm"] for c in curves[1]]
    assert [c["lm"] for c in curves[2]] == pytest.approx([c["lm"] for c in curves[0]], rel=1e-3)
    assert len(curves[0]) == SMALL.steps and curves[0][0]["tokens"] > 0
    assert (tmp_path / "a" / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    accuracy = evaluate(tmp_path / "a", SMALL, "cpu")
    assert set(accuracy) == set(demo_data.TASKS) and all(0 <= a <= 1 for a in accuracy.values())
    answers = [json.loads(line) for line in (tmp_path / "a" / "eval_answers.jsonl").read_text().splitlines()]
    assert len(answers) == SMALL.eval_per_task * len(demo_data.TASKS)
    for task, share in accuracy.items():  # the kept verdicts are the ones counted
        verdicts = [a["ok"] for a in answers if a["task"] == task]
        assert sum(verdicts) / len(verdicts) == pytest.approx(share, abs=1e-4)


def test_replicas_take_the_step_one_process_takes_and_stay_identical(items, tmp_path):
    """Two replicas (forked, each a share of the rows) and three (one with no row at all) end a step with the same
    weights as one process on all the rows, and bit-identical to each other; their losses are the step's."""
    rows = next(batches(items, 3000, 1200, seed=1))[:2]  # two rows: three replicas leave one without a row
    assert len(rows) == 2

    def step(replicas: Replicas) -> tuple[dict[str, float], list[torch.Tensor]]:
        model = initial_model(SMALL, CPU)
        # SGD: its step is the gradient's, so the weights compare as closely as the summed gradients do.
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        measured = train_step(model, optimizer, rows, SMALL, 3, CPU, replicas)
        return measured, [t.detach().clone() for t in model.state_dict().values()]

    alone, weights = step(Replicas())
    for count in (2, 3):
        floats = sum(p.numel() for p in initial_model(SMALL, CPU).parameters()) + len(LOSSES) + 64
        replicas = Replicas(count, floats)

        def replica(replicas: Replicas = replicas, count: int = count) -> None:
            measured, tensors = step(replicas)
            torch.save({"measured": measured, "weights": tensors}, tmp_path / f"{count}-{replicas.index}.pt")

        replicas.run(replica)
        runs = [torch.load(tmp_path / f"{count}-{i}.pt") for i in range(count)]
        for run in runs:
            assert all(torch.equal(a, b) for a, b in zip(run["weights"], runs[0]["weights"], strict=True))
            assert run["measured"] == runs[0]["measured"]
        assert runs[0]["measured"] == pytest.approx(alone, rel=1e-5)
        for a, b in zip(runs[0]["weights"], weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_replica_that_fails_ends_the_run_with_its_error():
    """The others stop at their next sum, not after the timeout; the trainer raises with the failing one's error."""
    replicas = Replicas(3, floats=1, timeout_s=600)

    def replica() -> None:
        if replicas.index == 1:
            raise ValueError("no rows for replica 1")
        replicas.any(False)

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replica 1 of 3 failed: ValueError: no rows for replica 1"):
        replicas.run(replica)
    assert time.monotonic() - started < 60


def test_a_replica_that_hangs_prints_its_stack_and_the_run_ends(capfd):
    """A replica stuck before its step's sum prints where it is once the timeout has passed; the others give up
    waiting for it, and the trainer ends the run instead of waiting forever."""
    replicas = Replicas(2, floats=1, timeout_s=2)

    def stuck_before_its_sum() -> None:
        time.sleep(120)

    def replica() -> None:
        if replicas.index == 1:
            stuck_before_its_sum()
        replicas.any(False)

    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"replicas ended without finishing .* printed its stack to stderr after 2 s"
    ):
        replicas.run(replica)
    assert time.monotonic() - started < 60
    assert "in stuck_before_its_sum" in capfd.readouterr().err


def test_replicas_sum_after_the_trainer_used_its_cpu_threads(monkeypatch):
    """On a host with more cores than replicas, a replica forked after the trainer's parallel CPU work sums a
    model's worth of floats: GNU OpenMP's pool does not survive a fork, and a replica that used one hung in its
    first parallel copy (both replicas of the first GPU runs, at their first sum)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4 * max(2, torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.randn(4_000_000).mul_(2)  # the trainer's own parallel region, before the fork
    n = 4_000_000
    replicas = Replicas(2, floats=n, timeout_s=20)

    def replica() -> None:
        gradient = torch.full((n,), float(replicas.index + 1))
        replicas.sum([gradient])
        if not torch.equal(gradient, torch.full((n,), 3.0)):
            raise AssertionError("the replicas' sum is not 1 + 2")

    try:
        replicas.run(replica)
    finally:
        torch.set_num_threads(threads)


def test_steps_pack_every_sample_once_an_epoch_into_rows_within_their_limits(items):
    row_tokens, tokens_per_step = 1200, 2500
    epoch = sum(len(e.ids) for e in items)
    seen, steps = [], batches(items, tokens_per_step, row_tokens, seed=3)
    while sum(len(e.ids) for e in seen) < epoch:
        rows = next(steps)
        tokens = [len(e.ids) for row in rows for e in row]
        assert sum(tokens) <= tokens_per_step or len(tokens) == 1
        assert all(sum(len(e.ids) for e in row) <= row_tokens for row in rows if len(row) > 1)
        seen += [e for row in rows for e in row]
    assert sorted(map(id, seen)) == sorted(map(id, items))


def test_a_row_holds_needles_of_distinct_kinds_and_the_step_its_tokens(items):
    """A haystack's needle of the kind a later question asks for would make it ambiguous; needles of other kinds
    share a row (distractors); the rows that rule opens do not shorten the step."""
    assert [type(e.needle) for e in items if e.needle is not None] == [str]  # the retrieval sample's code kind
    kinds = ("vault", "locker", None, None)
    mixed = [Example(torch.arange(100), 50, needle=kinds[i % 4]) for i in range(40)]
    steps = batches(mixed, tokens_per_step=2000, row_tokens=400, seed=3)  # 20 samples a step, 4 a row at most
    for _ in range(4):
        rows = next(steps)
        assert sum(len(e.ids) for row in rows for e in row) == 2000
        needles = [[e.needle for e in row if e.needle] for row in rows]
        assert all(len(set(n)) == len(n) for n in needles) and any(len(n) == 2 for n in needles)


def test_the_dense_warm_up_attends_every_visible_c4_row(items):
    """With a top-k that covers every row the indexer's choice is all of them: dense and sparse agree. With the tiny
    top-k of 8 they differ, so the warm-up's attention is not the served one's."""
    batch = next(batches(items, SMALL.tokens_per_step, SMALL.row_tokens, SMALL.seed))

    def lm(recipe: Recipe, dense: bool) -> float:
        model = initial_model(recipe, CPU)
        for attn in model.modules():
            if isinstance(attn, Attention) and attn.indexer is not None:
                attn.dense_warmup = dense
        with torch.no_grad():
            return losses(model, batch, CPU)["lm"].item()

    covering = Recipe(config=dict(TINY_CONFIG) | {"index_topk": SMALL.max_tokens // 4})
    assert lm(covering, True) == pytest.approx(lm(covering, False), rel=1e-5)
    # the same tolerance both ways: only the rows a row's queries skip make the difference (a few 1e-4 of the loss
    # of a random model, whose attention is nearly uniform)
    assert lm(SMALL, True) != pytest.approx(lm(SMALL, False), rel=1e-5)


def test_a_row_must_hold_the_longest_sample():
    with pytest.raises(ValueError, match=r"row_tokens \(2048\) must hold the longest sample, max_tokens \(4096\)"):
        Recipe(row_tokens=2048)
    assert Recipe(row_tokens=16_384).row_tokens == 16_384


def test_a_run_goes_on_from_a_checkpoint_at_its_step_of_the_schedule(tmp_path):
    recipe = dataclasses.replace(SMALL, steps=3, dense_warmup_steps=1)
    train(recipe, tmp_path / "first", CPU, stop_after_s=1e-9)  # ends after its first step
    first = json.loads((tmp_path / "first" / "train_log.json").read_text())["curve"]
    assert [c["step"] for c in first] == [0]
    resumed = dataclasses.replace(recipe, init=str(tmp_path / "first"), first_step=1)
    train(resumed, tmp_path / "second", CPU)
    log = json.loads((tmp_path / "second" / "train_log.json").read_text())
    second = log["curve"]
    assert [c["step"] for c in second] == [0, 1, 2]  # the whole run's curve, its tokens counted on
    # Each call's recipe and steps: what reproduces a run whose calls ended by time.
    assert [(c["first_step"], c["last_step"], c["recipe"]["init"]) for c in log["calls"]] == [
        (0, 0, ""),
        (1, 2, str(tmp_path / "first")),
    ]
    assert second[0] == first[0] and second[0]["tokens"] < second[1]["tokens"] < second[2]["tokens"]
    # Warmed up again from the run's first step, on the schedule's cosine; its samples drawn anew.
    schedule = Recipe(lr=1.0, min_lr_ratio=0.0, warmup_steps=10, steps=110, first_step=60)
    assert schedule.lr_at(60) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule.lr_at(70) == pytest.approx(dataclasses.replace(schedule, first_step=0).lr_at(70))
    assert resumed.data_seed != recipe.data_seed
