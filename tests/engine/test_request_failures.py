"""A request that fails inside the engine fails alone: the others of its batch finish as they would have, its pages go
back, and the engine serves on — through the engine core (`LLM`) and through the server's engine loop, with the
failure injected into one request of a running batch (a constraint that raises, as a broken grammar would) or into
a whole step. Only a run of failed steps, which no request explains, ends the engine."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import MAX_FAILED_STEPS
from engine.server.engine_loop import EngineLoop, RequestFailed
from engine.server.metrics import Metrics

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class FailsAtToken:
    """A constraint that lets the model choose, until its `n`-th token, where it raises."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def next_token(self, logits: torch.Tensor, remaining: int, draw) -> int:
        self.seen += 1
        if self.seen == self.n:
            raise RuntimeError("injected grammar failure")
        return draw(logits)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", quant_sim=False)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (12, 7, 20)]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _all_pages_free(llm: LLM) -> bool:
    pool = llm.engine.scheduler.blocks
    return pool.num_free == pool.num_pages


def test_a_request_whose_sampling_fails_mid_batch_fails_alone(llm, prompts, expected):
    failing = dataclasses.replace(GREEDY, constraint=FailsAtToken(3))
    first, broken, last = llm.generate(prompts, [GREEDY, failing, GREEDY])
    assert broken.finish_reason == "error" and "injected grammar failure" in broken.error
    assert len(broken.token_ids) == 2  # the tokens before the failure stay its own
    assert [first.token_ids, last.token_ids] == [expected[0], expected[2]]
    assert _all_pages_free(llm) and not llm.engine.has_unfinished()
    assert llm.generate(prompts[1], GREEDY)[0].token_ids == expected[1]


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(llm, prompts, expected, monkeypatch):
    launch, calls = llm.engine.runner.launch, []

    def fails_third_step(work, previous):
        calls.append(len(work))
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return launch(work, previous)

    monkeypatch.setattr(llm.engine.runner, "launch", fails_third_step)
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.finish_reason == "error" and "injected step failure" in o.error for o in outputs)
    assert _all_pages_free(llm) and llm.engine.failed_steps == 1
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.failed_steps == 0


def test_steps_that_keep_failing_end_the_engine(llm, prompts, monkeypatch):
    def always_fails(work, previous):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.engine.runner, "launch", always_fails)
    with pytest.raises(RuntimeError, match="the device is gone"):
        for _ in range(MAX_FAILED_STEPS):
            llm.engine.add_request(prompts[0], GREEDY)
            while llm.engine.has_unfinished():
                llm.engine.step()
    assert llm.engine.failed_steps == MAX_FAILED_STEPS
    monkeypatch.undo()
    for request_id in list(llm.engine.sequences):
        llm.engine.abort(request_id)
    llm.engine.failed_steps = 0


def test_the_server_loop_answers_the_failed_request_with_500_and_serves_on(llm, prompts, expected):
    failures: list[BaseException] = []
    loop = EngineLoop(llm.engine, Metrics(), failures.append)
    loop.start()

    async def tokens(stream) -> list[int] | RequestFailed:
        try:
            async for output in stream:
                if output.finished:
                    return output.token_ids
        except RequestFailed as failure:
            return failure

    async def run() -> list:
        failing = dataclasses.replace(GREEDY, constraint=FailsAtToken(2))
        streams = [
            loop.submit(f"r{i}", prompt, params)
            for i, (prompt, params) in enumerate(zip(prompts, [GREEDY, failing, GREEDY], strict=True))
        ]
        return await asyncio.gather(*(tokens(stream) for stream in streams))

    try:
        first, broken, last = asyncio.run(run())
        after = asyncio.run(run())[0]
    finally:
        loop.stop()
    assert isinstance(broken, RequestFailed) and broken.status == 500
    assert "injected grammar failure" in broken.message and "serves on" in broken.message
    assert [first, last, after] == [expected[0], expected[2], expected[0]]
    assert failures == [] and loop.failure is None and loop.num_unfinished == 0
