"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, a thin loop over the engine's step()."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", quant_sim=False)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (200, 37, 130, 5, 260)]


def test_greedy_decode_equals_transformers_generate(llm, prompts):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(llm.engine.config.model, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    out = llm.generate(prompts[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected[0, 200:].tolist()
    assert out.finish_reason == "length" and out.text == llm.engine.tokenizer.decode(out.token_ids)


def test_batched_generation_gives_what_each_prompt_gives_alone(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_limits_force_chunked_prefill_and_queueing_without_changing_results(tiny_dir, llm, prompts):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    small = LLM(
        str(tiny_dir), dtype="float32", quant_sim=False, max_num_seqs=2, max_num_batched_tokens=64, cuda_graph_max_bs=2
    )
    assert [o.token_ids for o in small.generate(prompts, params)] == expected


def test_text_prompts_seeds_logprobs_and_stops(llm):
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=11, logprobs=3)
    a, b = llm.generate(["Hello there", "Hello there"], [sampled, sampled])
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1
    other = llm.generate("Hello there", SamplingParams(max_tokens=24, temperature=0.9, seed=12))[0]
    assert other.token_ids != a.token_ids
    assert len(a.logprobs) == len(a.token_ids)
    first = a.logprobs[0]
    assert first.token_id == a.token_ids[0] and len(first.top) == 3 and first.logprob <= 0
    assert max(first.top.values()) >= first.logprob
    # A stop string ends the request and is not part of the text.
    full = llm.generate("Hello there", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    stop = full[5:7]
    cut = llm.generate("Hello there", SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    # A stop token id ends it too, the token included in token_ids.
    token = llm.generate("Hello there", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].token_ids[3]
    by_id = llm.generate("Hello there", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[token]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == token


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_at_the_context_length_is_refused(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", context_length=64)
    with pytest.raises(ValueError, match="64 tokens; context_length is 64"):
        llm.generate([5] * 64)


def test_the_output_budget_is_set_once_and_the_grammar_counts_down_from_it(tiny_dir):
    """A budget past the context is lowered when the request is added (the server clamps by the same rule), and a
    grammar is told what is left of that budget, not of the max_tokens asked for."""
    short = LLM(str(tiny_dir), dtype="float32", quant_sim=False, context_length=40)
    seen: list[int] = []

    class Recording:
        def next_token(self, logits, remaining, draw):
            seen.append(remaining)
            return draw(logits)

    params = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True, constraint=Recording())
    out = short.generate(list(range(2, 32)), params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert seen == list(range(10, 0, -1))
