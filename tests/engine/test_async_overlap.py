"""Overlapped steps (llm_engine.py): the engine queues step n+1 before it reads step n's tokens. Everything a client
sees must equal the engine without overlap (`engine.overlap = False`): tokens, text, stops, lengths, logprobs, seeds,
preemption, aborts; no token of a finished request is ever delivered, and every page comes back.

A request that stops on a token runs one step more with overlap, so the two modes may batch the others differently
for a step. On the CPU a request's numbers do not depend on its batch, so these compare on the CPU; on a GPU, whose
kernels may round differently at another batch size, only batches that both modes schedule alike (requests that end
by max_tokens) are compared, with CUDA graphs, in the last test."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine, RequestOutput


def make_engine(tiny_dir, overlap: bool, **overrides) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", "quant_sim": False, "context_length": 1024} | overrides
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), **config))
    engine.overlap = overlap
    return engine


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in lengths]


def stream_all(engine: LLMEngine, on_step=None) -> dict[str, list[RequestOutput]]:
    """Every output each request got, in order, checking the stream as a client reads it."""
    streams: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            seen = streams.setdefault(output.request_id, [])
            assert not seen or not seen[-1].finished, f"{output.request_id} got an output after it finished"
            seen.append(output)
        steps += 1
        if on_step is not None:
            on_step(engine, streams, steps)
    pool = engine.scheduler.blocks
    assert pool.num_free == pool.num_pages, "every page comes back"
    return streams


def summary(streams: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    """What a client got per request; the deltas must add up to the final output."""
    result = {}
    for request_id, outputs in streams.items():
        final = outputs[-1]
        assert final.finished
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in outputs) == final.text
        logprobs = [(lp.token_id, round(lp.logprob, 5), sorted(lp.top)) for lp in final.logprobs or []]
        result[request_id] = (tuple(final.token_ids), final.text, final.finish_reason, tuple(logprobs))
    return result


def run_both(tiny_dir, requests, on_step=None, **overrides) -> tuple[dict, dict, int]:
    """Both modes on the same requests; the overlapped engine's count of steps left in flight."""
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_dir, overlap, **overrides)
        for request_id, prompt, params in requests:
            engine.add_request(prompt, params, request_id)
        overlapped = []
        engine_step = engine.step

        def counting_step(engine=engine, engine_step=engine_step, overlapped=overlapped):
            outputs = engine_step()
            overlapped.append(engine.in_flight is not None)
            return outputs

        engine.step = counting_step
        results.append((summary(stream_all(engine, on_step)), sum(overlapped)))
    (sync, sync_overlapped), (overlap, overlap_count) = results
    assert sync_overlapped == 0
    return sync, overlap, overlap_count


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def test_greedy_batch_of_different_lengths_stops_and_limits_is_identical(tiny_dir):
    reference = make_engine(tiny_dir, False)
    first = reference.add_request(prompts(9)[0], greedy(30), "probe")
    text = summary(stream_all(reference))[first][1]
    stop = text[10:12]
    assert stop and stop not in text[:10]
    a, b, c, d, e, f = prompts(200, 37, 130, 5, 260, 64)
    requests = [
        ("long", a, greedy(25)),
        ("one", b, greedy(1)),
        ("two", c, greedy(2)),
        ("stop-string", prompts(9)[0], greedy(30, stop=[stop])),
        ("short", d, greedy(7)),
        ("chunked", e, greedy(12)),
        ("eos", f, SamplingParams(max_tokens=20, temperature=0)),
    ]
    sync, overlap, overlapped = run_both(tiny_dir, requests, max_num_seqs=4, max_num_batched_tokens=128)
    assert overlap == sync
    assert sync["stop-string"][2] == "stop" and sync["stop-string"][1] == text[: text.index(stop)]
    assert len(sync["one"][0]) == 1 and len(sync["two"][0]) == 2 and len(sync["long"][0]) == 25
    assert overlapped > 20, "greedy decode steps stay in flight"


def test_stop_token_ids_and_the_context_limit_are_identical(tiny_dir):
    reference = make_engine(tiny_dir, False)
    reference.add_request(prompts(40)[0], greedy(20), "probe")
    tokens = summary(stream_all(reference))["probe"][0]
    requests = [
        ("by-id", prompts(40)[0], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tokens[4]])),
        ("context", prompts(1000)[0], greedy(100)),  # 24 tokens to the context length
    ]
    sync, overlap, _ = run_both(tiny_dir, requests)
    assert overlap == sync
    assert sync["by-id"][2] == "stop" and sync["by-id"][0][-1] == tokens[4]
    assert sync["context"][2] == "length" and len(sync["context"][0]) == 24


def test_seeded_sampling_and_logprobs_mixed_with_greedy_are_identical(tiny_dir):
    a, b, c, d = prompts(50, 120, 33, 70)
    requests = [
        ("greedy", a, greedy(20)),
        ("seeded", b, SamplingParams(max_tokens=15, temperature=0.8, top_k=40, top_p=0.9, seed=7, ignore_eos=True)),
        ("logprobs", c, greedy(12, logprobs=2)),
        ("greedy-late", d, greedy(30)),
    ]
    sync, overlap, overlapped = run_both(tiny_dir, requests)
    assert overlap == sync
    assert len(sync["logprobs"][3]) == 12
    assert overlapped > 0, "once only greedy requests are left, steps overlap"


@pytest.mark.slow
def test_preemption_by_recompute_is_identical(tiny_dir):
    batch = prompts(200, 190, 210, 195)
    requests = [(f"r{i}", p, greedy(60)) for i, p in enumerate(batch)]
    requests[2] = ("r2", batch[2], SamplingParams(max_tokens=40, temperature=0.7, seed=3, ignore_eos=True))
    preemptions = []

    def check(engine, streams, steps):
        preemptions.append(engine.scheduler.num_preemptions)
        held = sum(len(seq.page_table.pages) for seq in engine.scheduler.running)
        assert engine.scheduler.blocks.num_pages - engine.scheduler.blocks.num_free == held

    sync, overlap, _ = run_both(tiny_dir, requests, on_step=check, max_num_seqs=4, num_kv_pages=3)
    assert overlap == sync and preemptions[-1] > 0
    ample, _, _ = run_both(tiny_dir, requests, max_num_seqs=4)
    assert sync == ample


def test_abort_mid_generation_delivers_nothing_after_it_and_frees_its_pages(tiny_dir):
    a, b = prompts(300, 80)
    kept = {}
    for overlap in (False, True):
        engine = make_engine(tiny_dir, overlap, num_kv_pages=8)
        engine.add_request(a, greedy(100), "aborted")
        engine.add_request(b, greedy(40), "kept")
        aborted: list[RequestOutput] = []

        def abort_after_five(engine, streams, steps, aborted=aborted):
            got = streams.get("aborted", [])
            if not aborted and len(got) == 5:
                final = engine.abort("aborted")
                aborted.append(final)
                assert final.finish_reason == "abort" and final.token_ids == got[-1].token_ids
                assert len(final.token_ids) == 5
                assert engine.scheduler.blocks.num_free == 8 - len(engine.scheduler.running[0].page_table.pages)

        streams = stream_all(engine, abort_after_five)
        assert aborted and len(streams["aborted"]) == 5, "no token of the aborted request is delivered after it"
        kept[overlap] = summary({"kept": streams["kept"]})["kept"]
    assert kept[True] == kept[False]


@pytest.mark.gpu
def test_cuda_graph_steps_overlap_and_give_what_synchronous_steps_give(tiny_dir):
    """Greedy requests that end by max_tokens, arriving in two waves: both modes run the same batches (a request whose
    token in flight is its last gives its pages back before the next step is scheduled), so even a GPU gives the
    same tokens. The page tables grow across pages, and new requests are admitted while others decode."""
    batch = prompts(3, 70, 260, 500, 31, 129)
    requests = [(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(batch, (24, 40, 9, 30, 1, 17), strict=True))]
    cuda = {"device": "cuda", "kv_cache_dtype": "float32", "max_num_seqs": 4, "num_kv_pages": 24}
    sync, overlap, overlapped = run_both(tiny_dir, requests, **cuda)
    assert overlap == sync and overlapped > 20
