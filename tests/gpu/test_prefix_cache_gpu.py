"""Prefix caching at V4-Flash widths (bf16 weights, FP8 KV) with decode in CUDA graphs: a request whose prompt extends
an earlier one's restores the earlier one's snapshot, prefills only the rest, and gives the tokens of a cache-off
engine whose prefill is chunked at the same page boundaries — a page of tokens per step, so both engines compute the
same rows in the same chunks and the reuse must be exact, bit for bit. Requests that arrive together with a common
prefix compute it once.

An answer's reuse is exact only where its rows were made the same way: rows a decode step wrote differ in their last
bits from rows a prefill writes, so a cache-off run cannot reproduce a reused answer in bf16; tests/engine's fp32
conversations cover answers."""

from __future__ import annotations

import pytest
import torch

from bench.shapes import write_model_dir
from engine import LLM, SamplingParams
from tests.engine.test_prefix_cache import count_computed_prompt_tokens

pytestmark = pytest.mark.gpu
PAGE = 256
CONFIG = dict(device="cuda", load_format="dummy", dtype="bfloat16", context_length=4096, max_num_seqs=2,
              max_num_batched_tokens=PAGE, num_kv_pages=40, cuda_graph_max_bs=2)  # fmt: skip
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    """V4-Flash's shipped formats (FP8 dense, MXFP4 experts): two engines of its width fit one H100."""
    return write_model_dir(tmp_path_factory.mktemp("models") / "flash", official_formats=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 120000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engines(flash_dir):
    """One engine with the cache and one without (each seeds the same dummy weights), shared by the tests."""
    with LLM(str(flash_dir), prefix_cache=True, **CONFIG) as cached, LLM(str(flash_dir), prefix_cache=False,
                                                                       **CONFIG) as plain:  # fmt: skip
        assert cached.engine.runner.graphs is not None and cached.engine.runner.graphs.sizes == [1, 2]
        yield cached, plain


@pytest.mark.parametrize(
    ("first", "reused"),
    [
        (1000, 768),  # the prefix ends inside a page: its last whole page boundary's snapshot
        (768, 768),  # on a page boundary: the snapshot taken where the earlier prompt's prefill ended
    ],
)
def test_a_prompt_that_extends_an_earlier_one_reuses_it_exactly(engines, first, reused):
    cached, plain = engines
    computed = count_computed_prompt_tokens(cached.engine)
    earlier = _tokens(first, seed=first)
    later = earlier + _tokens(200, seed=first + 1)
    cached.generate(earlier, PARAMS)
    with_cache = cached.generate(later, PARAMS)[0]
    without = plain.generate(later, PARAMS)[0]
    assert with_cache.cached_tokens == reused and without.cached_tokens == 0
    assert computed[with_cache.request_id] == len(later) - reused
    assert with_cache.token_ids == without.token_ids


def test_requests_that_arrive_together_compute_their_common_prefix_once(engines):
    cached, _ = engines
    computed = count_computed_prompt_tokens(cached.engine)
    common = _tokens(900, seed=7)
    prompts = [common + _tokens(150, seed=8), common + _tokens(150, seed=9)]
    first, second = cached.generate(prompts, PARAMS)
    assert (first.cached_tokens, second.cached_tokens) == (0, 768)
    assert computed[first.request_id] == len(prompts[0])
    assert computed[second.request_id] == len(prompts[1]) - 768
