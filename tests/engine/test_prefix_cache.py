"""Prefix caching on the CPU in fp32 (engine/cache/block_manager.py): conversations whose next turn re-sends the last
one give the tokens the engine gives without the cache, and `cached_tokens` is what was not computed — counted from
the steps the runner actually ran. Prefixes end inside a page, on a page boundary, inside the window after one, and
beyond it; an answer's pages are reused too. Eviction under a full pool, preemption of requests that hold shared
pages, and requests that arrive together with a common prefix (computed once).

quant_sim is off: its FP8/FP4 roundings of rows computed by a decode step and by a prefill step differ in their last
bits, which turns into other tokens in the random tiny model whenever an answer's tokens are reused rather than
prefilled again (a prompt's reuse is exact either way, as the first test shows)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # whole engines, several turns each, with and without the cache
PAGE = 256


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(tiny_dir, prefix_cache: bool, **config) -> LLM:
    config = dict(dtype="float32", quant_sim=False, context_length=2048, max_num_seqs=3, max_num_batched_tokens=512,
                  num_kv_pages=24) | config  # fmt: skip
    return LLM(str(tiny_dir), prefix_cache=prefix_cache, **config)


def count_computed_prompt_tokens(engine: LLMEngine) -> dict[str, int]:
    """Per request, the prompt tokens the steps ran (read from the work each step hands the runner)."""
    computed: dict[str, int] = {}
    launch = engine.runner.launch

    def counted(work, previous):
        for item in work:
            seq = item.seq
            prompt_part = min(item.num_tokens, max(0, len(seq.prompt_ids) - seq.num_computed))
            computed[seq.request_id] = computed.get(seq.request_id, 0) + prompt_part
        return launch(work, previous)

    engine.runner.launch = counted
    return computed


def _conversation(llm: LLM, first: list[int], max_tokens: int, turns: int = 3) -> list:
    """Each turn re-sends the conversation so far (prompt and answer) and adds 30 new tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, prompt = [], first
    for turn in range(turns):
        output = llm.generate(prompt, params)[0]
        outputs.append(output)
        prompt = prompt + output.token_ids + _tokens(30, seed=100 + turn)
    return outputs


@pytest.mark.parametrize(
    ("first", "max_tokens"),
    [
        (300, 20),  # the shared prefix ends inside a page
        (512, 20),  # on a page boundary (the last page is computed: its last token samples)
        (262, 8),  # inside the window after a page boundary
        (740, 40),  # beyond it, with an answer that ends a page of its own
    ],
)
def test_a_conversation_reuses_its_earlier_turns_and_answers_alike(tiny_dir, first, max_tokens):
    with _llm(tiny_dir, True) as cached_llm, _llm(tiny_dir, False) as plain_llm:
        computed = count_computed_prompt_tokens(cached_llm.engine)
        with_cache = _conversation(cached_llm, _tokens(first, seed=first), max_tokens)
        without = _conversation(plain_llm, _tokens(first, seed=first), max_tokens)
        assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
        assert [o.cached_tokens for o in without] == [0, 0, 0]
        for output in with_cache:
            assert computed[output.request_id] + output.cached_tokens == len(output.prompt_token_ids)
        assert with_cache[0].cached_tokens == 0
        for earlier, later in zip(with_cache, with_cache[1:], strict=False):
            # At least every whole page of what the earlier turn's request held (prompt and answer).
            held = len(earlier.prompt_token_ids) + len(earlier.token_ids) - 1
            assert later.cached_tokens >= min(held, len(later.prompt_token_ids) - 1) // PAGE * PAGE > 0
        blocks = cached_llm.engine.scheduler.blocks
        assert blocks.hit_tokens == sum(o.cached_tokens for o in with_cache)
        assert blocks.num_free == blocks.num_pages  # cached pages count as free


def test_a_prompt_is_reused_exactly_with_quant_sim(tiny_dir):
    """The same 600-token prompt twice, the official FP8/FP4 rounding on: the second prefills 88 tokens after a
    restored 512 and its logprobs equal the first's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = _tokens(600, seed=5)
    with _llm(tiny_dir, True, quant_sim=True) as llm:
        first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert second.cached_tokens == 512 and second.token_ids == first.token_ids
    drift = max(abs(a.logprob - b.logprob) for a, b in zip(first.logprobs, second.logprobs, strict=True))
    assert drift < 1e-4


def test_eviction_under_a_full_pool_keeps_outputs_and_frees_the_oldest(tiny_dir):
    """Ten distinct 300-token prompts through a pool of 6 pages: cached prefixes give way, oldest first; each output
    is the cache-off one; the most recent prefix is still there for a repeat, the first one is not."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [_tokens(300, seed=i) for i in range(10)]
    config = dict(num_kv_pages=6, max_num_seqs=2)
    with _llm(tiny_dir, True, **config) as cached_llm, _llm(tiny_dir, False, **config) as plain_llm:
        with_cache = [cached_llm.generate(p, params)[0].token_ids for p in prompts]
        assert with_cache == [plain_llm.generate(p, params)[0].token_ids for p in prompts]
        blocks = cached_llm.engine.scheduler.blocks
        assert 0 < len(blocks.prefixes) < 10 and blocks.num_free == blocks.num_pages
        again_last, again_first = (cached_llm.generate(p, params)[0] for p in (prompts[-1], prompts[0]))
        assert again_last.cached_tokens == 256 and again_last.token_ids == with_cache[-1]
        assert again_first.cached_tokens == 0 and again_first.token_ids == with_cache[0]


def test_preempting_requests_that_hold_shared_pages_loses_nothing(tiny_dir):
    """A cached 256-token prefix, then three requests on it with long answers in a pool that cannot hold them all:
    the youngest are preempted and re-admitted (from the cache), every output is the cache-off one, and the pages
    all come back."""
    prefix = _tokens(300, seed=7)
    prompts = [prefix + _tokens(20, seed=8 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    config = dict(num_kv_pages=6, max_num_seqs=3)
    with _llm(tiny_dir, True, **config) as cached_llm, _llm(tiny_dir, False, **config) as plain_llm:
        cached_llm.generate(prefix, SamplingParams(temperature=0, max_tokens=1))
        with_cache = cached_llm.generate(prompts, params)
        assert [o.token_ids for o in with_cache] == [o.token_ids for o in plain_llm.generate(prompts, params)]
        scheduler = cached_llm.engine.scheduler
        assert scheduler.num_preemptions > 0 and all(o.cached_tokens == 256 for o in with_cache)
        assert scheduler.blocks.num_free == scheduler.blocks.num_pages


def test_requests_arriving_together_compute_their_common_prefix_once(tiny_dir):
    """Three requests with a common 600-token prefix, added at once: the first computes the 512 tokens of whole
    pages they share, the others take them from its snapshot."""
    prefix = _tokens(600, seed=9)
    prompts = [prefix + _tokens(25, seed=10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _llm(tiny_dir, True) as cached_llm, _llm(tiny_dir, False) as plain_llm:
        computed = count_computed_prompt_tokens(cached_llm.engine)
        with_cache = cached_llm.generate(prompts, params)
        assert [o.token_ids for o in with_cache] == [o.token_ids for o in plain_llm.generate(prompts, params)]
    assert [o.cached_tokens for o in with_cache] == [0, 512, 512]
    assert sum(computed.values()) == sum(map(len, prompts)) - 2 * 512


def test_a_request_that_waits_behind_a_long_prefill_still_shares_its_prefix(tiny_dir):
    """A page of tokens a step: the first prompt's prefill spends every step's budget, so the second cannot run yet,
    but the first snapshots at their common pages (768 tokens) and the second starts from there."""
    common = _tokens(900, seed=21)
    prompts = [common + _tokens(150, seed=22), common + _tokens(150, seed=23)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _llm(tiny_dir, True, max_num_batched_tokens=PAGE, num_kv_pages=40) as cached_llm:
        computed = count_computed_prompt_tokens(cached_llm.engine)
        with_cache = cached_llm.generate(prompts, params)
    assert [o.cached_tokens for o in with_cache] == [0, 768]
    assert [computed[o.request_id] for o in with_cache] == [len(prompts[0]), len(prompts[1]) - 768]


def test_a_boundary_inside_a_chunk_costs_no_extra_step(tiny_dir):
    """A 700-token prompt in one 1024-token chunk: the snapshot at its last page boundary (512) is taken between the
    two rows the chunk runs as, in the same step, so the cache adds no step; the next turn starts from it."""
    prompt = _tokens(700, seed=31)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    steps = {}
    for prefix_cache in (True, False):
        with _llm(tiny_dir, prefix_cache, max_num_batched_tokens=1024) as llm:
            launched = []

            def counted(work, previous, launch=llm.engine.runner.launch, launched=launched):
                launched.append(work)
                return launch(work, previous)

            llm.engine.runner.launch = counted
            first = llm.generate(prompt, params)[0]
            steps[prefix_cache] = len(launched)
            if prefix_cache:
                assert [w.splits[0][0] for w in launched[0]] == [512] and launched[0][0].num_tokens == 700
                assert llm.generate(prompt + first.token_ids, params)[0].cached_tokens == 512
    assert steps[True] == steps[False]
