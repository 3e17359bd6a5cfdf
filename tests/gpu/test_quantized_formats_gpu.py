"""The official-layout checkpoint (FP8 linears, MXFP4 experts) and ModelOpt's (NVFP4 experts) served as stored on a
GPU: the linears and experts run their Triton kernels, in CUDA graphs too, and compute what the plain-torch references
compute on the CPU from the same bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.llm import LLM
from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.sampling_params import SamplingParams
from engine.standalone import Standalone
from engine.tools.make_tiny import make_tiny

pytestmark = pytest.mark.gpu

QUANTIZED = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


@pytest.fixture(scope="module", params=["official", "nvfp4"])
def official_dir(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / f"tiny-{request.param}", layout=request.param)


def _prefill_logits(model_dir, device: str) -> torch.Tensor:
    model = Standalone.allocate(load_model(model_dir, dtype=torch.float32, device=device, quant_sim=False), 32, 4,
                                "float32")  # fmt: skip
    ids = torch.randint(2, 1024, (300,), generator=torch.Generator().manual_seed(7)).to(device)
    state = model.new_state()
    with torch.no_grad():
        logits = model.logits(model(ForwardBatch(ids, torch.arange(300, device=device), [state], [300])))
    return logits.cpu()


def test_the_triton_path_computes_the_references_on_the_stored_bytes(official_dir):
    gpu, cpu = _prefill_logits(official_dir, "cuda"), _prefill_logits(official_dir, "cpu")
    # Same codes, scales and activation rounding; the fp32 sums run in another order (tensor-core dots, split-K), and
    # where that moves an activation across an e4m3 rounding boundary the next FP8 linear sees one code apart.
    cos = torch.nn.functional.cosine_similarity(gpu, cpu, dim=-1)
    assert cos.mean() > 0.995 and cos.min() > 0.95, cos
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() > 0.9


def test_gpu_memory_holds_the_stored_codes_not_dequantized_copies(official_dir):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model(official_dir, dtype=torch.bfloat16, device="cuda")
    held = torch.cuda.memory_allocated() - before
    stored = load_file(official_dir / "model.safetensors")
    quantized = sum(t.numel() * t.element_size() for t in stored.values() if t.dtype in QUANTIZED)
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype in QUANTIZED)
    assert params == quantized
    total = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    assert held <= total * 1.02 + (2 << 20)  # the allocator's rounding; nothing else stays after loading


def test_the_engine_generates_the_same_tokens_from_graphs_and_eager_steps(official_dir):
    prompts = [list(range(5, 5 + n)) for n in (3, 70, 260)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = dict(device="cuda", dtype="float32", kv_cache_dtype="float32", quant_sim=False, context_length=1024,
                  max_num_seqs=4, num_kv_pages=24)  # fmt: skip
    graphed = LLM(official_dir, **config)
    assert graphed.engine.applied_config.weight_formats == "as_stored" and graphed.engine.runner.graphs is not None
    with_graphs = [out.token_ids for out in graphed.generate(prompts, params)]
    del graphed
    eager = LLM(official_dir, enforce_eager=True, **config)
    assert with_graphs == [out.token_ids for out in eager.generate(prompts, params)]
