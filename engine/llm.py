"""The offline API, in the style of vLLM: `LLM(model_dir).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Over several ranks (tensor_parallel_size > 1), `close()` (or leaving a `with` block) stops the others."""

    def __init__(self, model: str, **engine_config):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_config))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Text or token-id prompts in; per prompt, the completion's text, token ids and (if asked) logprobs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        order = [self.engine.add_request(p, dataclasses.replace(sp)) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
        return [done[request_id] for request_id in order]
