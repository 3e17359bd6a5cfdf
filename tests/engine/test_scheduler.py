"""The scheduler with the real tiny model: step budgets (decode first, chunked prefill), the running cap, KV pages that
follow each request's tokens, admission only when a prompt's pages are free, preemption by recompute that changes no
output, aborts that free pages at once, and the pool-capacity cap."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_engine(tiny_dir, **overrides) -> LLMEngine:
    config = {"dtype": "float32", "quant_sim": False, "context_length": 1024} | overrides
    return LLMEngine(EngineConfig(model=str(tiny_dir), **config))


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in lengths]


def record_steps(engine: LLMEngine) -> list[list[tuple[str, int, bool]]]:
    """Each step's work as (request id, tokens, was decoding), seen as the runner receives it."""
    steps, launch = [], engine.runner.launch

    def observed(work, previous):
        steps.append([(w.seq.request_id, w.num_tokens, w.seq.decoding) for w in work])
        return launch(work, previous)

    engine.runner.launch = observed
    return steps


def run_all(engine: LLMEngine, check=None) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.token_ids)
        if check is not None:
            check(engine)
    return done


def pages_follow_tokens(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    held = 0
    for seq in scheduler.running:
        assert len(seq.page_table.pages) == -(-seq.num_computed // scheduler.blocks.page_size)
        held += len(seq.page_table.pages)
    assert all(not seq.page_table.pages for seq in scheduler.waiting)
    assert scheduler.blocks.num_pages - scheduler.blocks.num_free == held


def test_decode_goes_first_and_prefill_is_chunked_within_the_step_budget(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=3, max_num_batched_tokens=40)
    steps = record_steps(engine)
    short, long = prompts(10, 150)
    engine.add_request(short, GREEDY, "short")
    engine.step()  # "short" is prefilled and decodes from now on
    engine.add_request(long, GREEDY, "long")
    run_all(engine)
    assert all(sum(n for _, n, _ in work) <= 40 for work in steps)
    assert all(n == 1 for work in steps for _, n, decoding in work if decoding)
    chunks = [n for work in steps for rid, n, decoding in work if rid == "long" and not decoding]
    assert sum(chunks) == 150 and chunks[0] == 39  # the budget less "short"'s decode token


def test_no_more_than_max_num_seqs_run_and_results_match_one_at_a_time(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=2, max_num_batched_tokens=256)
    steps = record_steps(engine)
    batch = prompts(30, 5, 60, 17, 44)
    ids = [engine.add_request(p, GREEDY) for p in batch]
    together = run_all(engine, pages_follow_tokens)
    assert max(len(work) for work in steps) == 2
    alone = make_engine(tiny_dir, max_num_seqs=1, max_num_batched_tokens=256)
    for request_id, prompt in zip(ids, batch, strict=True):
        alone_id = alone.add_request(prompt, GREEDY)
        assert run_all(alone)[alone_id] == together[request_id]


def test_pages_grow_with_each_request_and_all_come_back(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=4, num_kv_pages=20)
    for prompt in prompts(120, 250, 129, 7):
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    run_all(engine, pages_follow_tokens)
    pool = engine.scheduler.blocks
    assert pool.num_free == pool.num_pages == 20 and pool.used_tokens == 0


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=4, num_kv_pages=3)
    first, second = prompts(500, 400)  # 2 pages each: both do not fit in 3
    engine.add_request(first, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "first")
    engine.add_request(second, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "second")
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["second"]
    run_all(engine, pages_follow_tokens)
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.slow
def test_preemption_by_recompute_changes_no_output(tiny_dir):
    batch = prompts(200, 190, 210, 195)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ample = make_engine(tiny_dir, max_num_seqs=4)
    small = make_engine(tiny_dir, max_num_seqs=4, num_kv_pages=3)  # each request grows to 2 pages of 256
    for engine in (ample, small):
        for i, p in enumerate(batch):
            engine.add_request(p, params, f"r{i}")
    expected = run_all(ample)
    preempted_first = []

    def check(engine: LLMEngine) -> None:
        pages_follow_tokens(engine)
        waiting = engine.scheduler.waiting
        if engine.scheduler.num_preemptions and not preempted_first and waiting and waiting[0].output_ids:
            preempted_first.append(waiting[0].request_id)

    assert run_all(small, check) == expected
    assert small.scheduler.num_preemptions > 0
    assert preempted_first and preempted_first[0] != "r0", "the oldest request is never the one preempted"


@pytest.mark.slow
def test_sampled_requests_resume_identically_after_preemption(tiny_dir):
    batch = prompts(230, 220, 240)
    params = SamplingParams(max_tokens=50, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    ample = make_engine(tiny_dir, max_num_seqs=3)
    small = make_engine(tiny_dir, max_num_seqs=3, num_kv_pages=2)
    for engine in (ample, small):
        for i, p in enumerate(batch):
            engine.add_request(p, params, f"r{i}")
    assert run_all(small) == run_all(ample) and small.scheduler.num_preemptions > 0


def test_abort_frees_pages_at_once(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=2, num_kv_pages=8)
    engine.add_request(prompts(300)[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), "a")
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_free == 6
    final = engine.abort("a")
    assert final.finish_reason == "abort" and engine.scheduler.blocks.num_free == 8
    assert not engine.has_unfinished() and engine.abort("a") is None


def test_no_request_grows_past_the_pool(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=2, num_kv_pages=2)  # 512 tokens, less than the context length
    assert engine.max_request_tokens == 512
    request_id = engine.add_request(prompts(450)[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    assert len(run_all(engine)[request_id]) == 62
    with pytest.raises(ValueError, match="the prompt has 512 tokens; the KV pool holds 512"):
        engine.add_request([5] * 512, GREEDY)


def test_the_cpu_pool_defaults_to_max_num_seqs_requests_at_full_context(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=3, context_length=300)
    assert engine.booted.num_pages == 2 * 3 and engine.kv_capacity_tokens == 6 * 256
    assert engine.applied_config.num_kv_pages == 6 and engine.applied_config.kv_cache_dtype == "float32"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_kv_pages", 0),
        ("max_waiting_requests", 0),
        ("request_timeout_s", 0),
        ("shutdown_grace_s", -1),
        ("port", 0),
        ("cuda_graph_max_bs", 64),
    ],
)
def test_bad_config_values_are_refused_with_the_field_named(tiny_dir, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(tiny_dir), **{field: value})
