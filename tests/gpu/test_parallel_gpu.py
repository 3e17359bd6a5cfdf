"""One engine over several GPUs through NCCL: the collectives inside captured CUDA graphs (at world size 1, on any
GPU), and — with two or more GPUs visible (the 2-GPU run issue executes these) — greedy tokens of 2 ranks in both
attention modes against 1, with decode graphs, and each GPU's memory in /server_info's figures."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

import engine.model.moe as moe_model
from engine.llm import LLM
from engine.model.linear import Layout, Shard
from engine.sampling_params import SamplingParams
from engine.tools.make_tiny import make_tiny

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (KINDS.md)

PROMPTS = [list(range(5, 5 + n)) for n in (3, 70, 260, 17)]
MAX_TOKENS = (24, 6, 16, 30)
CONFIG = dict(
    device="cuda",
    dtype="float32",
    kv_cache_dtype="float32",
    quant_sim=False,  # its FP4/FP8 roundings would turn last-bit differences of a split sum into other tokens
    context_length=1024,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    num_kv_pages=24,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")


def _generate(tiny_dir, **parallel) -> tuple[list[list[int]], dict]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(tiny_dir, **CONFIG, **parallel) as llm:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.sizes == [1, 2, 4]
        tokens = [out.token_ids for out in llm.generate(PROMPTS, params)]
        return tokens, {"memory": llm.engine.memory_per_rank, "capacity": llm.engine.kv_capacity_tokens}


def test_nccl_collectives_are_captured_in_a_cuda_graph(tmp_path):
    """World size 1 over NCCL: the data-parallel MoE's gather and scatter, and an all-reduce, issued inside a
    captured graph, replay to what the layer computes without them."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        args = types.SimpleNamespace(
            hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
            routed_scaling_factor=1.5, vocab_size=64, num_hash_layers=0, swiglu_limit=10.0,
            block_name=lambda i: f"layers.{i}",
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.device("cuda"):
            plain = moe_model.MoE(args, 0)
            gathered = moe_model.MoE(args, 0, layout=Layout(experts=Shard(0, 1), data_parallel=True))
            for param in plain.parameters():
                torch.nn.init.normal_(param, std=param.shape[-1] ** -0.5)
            gathered.load_state_dict(plain.state_dict())
            x = torch.randn(4, 256)
            ids = torch.randint(0, 64, (4,))
        with torch.inference_mode():
            want = plain(x, ids)
            gathered(x, ids, moe_rows=4)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gathered(x, ids, moe_rows=4)
                summed = out.clone()
                dist.all_reduce(summed)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
        # The routed sum is rounded before the shared expert is added (fp32 here: the order of sums differs).
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(summed, out)
    finally:
        dist.destroy_process_group()


@two_gpus
@pytest.mark.parametrize("attention", ["data-parallel", "tensor-parallel"])
def test_two_gpus_generate_what_one_generates(tiny_dir, attention):
    one, _ = _generate(tiny_dir)
    two, facts = _generate(tiny_dir, tensor_parallel_size=2, attention=attention)
    assert two == one
    assert len(facts["memory"]) == 2 and all(m.weights_bytes > 0 and m.kv_bytes > 0 for m in facts["memory"])
    assert facts["capacity"] == 24 * 256 * (2 if attention == "data-parallel" else 1)
