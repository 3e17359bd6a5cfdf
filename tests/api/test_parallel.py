"""One engine over several ranks, on the CPU through torch.distributed's gloo (the code NCCL runs on GPUs): 2 and 4
processes on tiny checkpoints, data-parallel and tensor-parallel attention, give the greedy tokens of one rank; a
rank that is killed or stopped ends the whole engine non-zero within 30 s, saying which rank; SIGTERM stops every
rank and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.args import ModelArgs
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.random_init import randomize
from engine.tools.make_tiny import SEED, TINY_CONFIG, save_hf_checkpoint
from engine.tools.tiny_tokenizer import save_tiny_tokenizer
from tests.api.conftest import EngineServer

pytestmark = pytest.mark.ranks

# Of different lengths: each outgrows the 16-token window but the first; one spans two KV pages; with a 64-token
# step budget the long prompt prefills in chunks beside the others' decode steps.
PROMPT_LENGTHS = (3, 40, 300, 9, 21)
MAX_TOKENS = (12, 4, 10, 16, 7)  # data-parallel ranks run out of requests at different steps
ENDS_WITHIN_S = 30


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, TINY_CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _generate(model_dir: Path, **parallel) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(str(model_dir), dtype="float32", context_length=1024, max_num_seqs=4, max_num_batched_tokens=64,
             num_kv_pages=12, **parallel) as llm:  # fmt: skip
        return [output.token_ids for output in llm.generate(_prompts(), params)]


@pytest.fixture(scope="module")
def four_groups_dir(tmp_path_factory) -> Path:
    """The tiny model with 4 output-projection groups (2 heads each), so its heads split over 4 ranks too."""
    out, config = tmp_path_factory.mktemp("tiny-4-groups"), TINY_CONFIG | {"o_groups": 4}
    save_hf_checkpoint(randomize(DeepseekV4(ModelArgs.from_config(config)), SEED).cast(torch.bfloat16), out, config)
    save_tiny_tokenizer(out, config["vocab_size"])
    return out


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    """The ranks (which inherit the environment) share the machine's two cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("attention", ["data-parallel", "tensor-parallel"])
def test_two_ranks_generate_what_one_rank_generates(tiny_dir, attention):
    assert _generate(tiny_dir, tensor_parallel_size=2, attention=attention) == _generate(tiny_dir)


@pytest.mark.parametrize("attention", ["data-parallel", "tensor-parallel"])
def test_four_ranks_generate_what_one_rank_generates(four_groups_dir, attention):
    one = _generate(four_groups_dir)
    assert _generate(four_groups_dir, tensor_parallel_size=4, attention=attention) == one


def test_a_model_that_does_not_split_is_refused_naming_what(tiny_dir):
    """The tiny model's 2 output groups do not split over 4 tensor-parallel ranks: boot fails, every rank ends."""
    with pytest.raises(ValueError, match=r"wo_a groups: 2 does not split evenly over 4 ranks"):
        LLM(str(tiny_dir), dtype="float32", tensor_parallel_size=4, attention="tensor-parallel")


def _two_rank_server(tiny_dir: Path, tmp_path: Path, attention: str = "data-parallel") -> tuple[EngineServer, int]:
    server = EngineServer(tiny_dir, tmp_path / "engine.jsonl", tensor_parallel_size=2, attention=attention,
                          max_num_seqs=2)  # fmt: skip
    (started,) = [line for line in server.logs() if line["event"] == "ranks_started"]
    (pid,) = started["pids"]
    info = server.http.get("/server_info").json()
    assert info["config"]["attention"] == attention and len(info["gpu_memory_per_rank"]) == 2
    return server, pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _ended(server: EngineServer, pid: int) -> tuple[int, float]:
    started = time.monotonic()
    code = server.proc.wait(ENDS_WITHIN_S)
    waited = time.monotonic() - started
    assert not _alive(pid), "the rank outlived the engine"
    return code, waited


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_or_stopped_ends_the_engine(tiny_dir, tmp_path, how):
    """With a request in flight: the engine exits non-zero within 30 s and its log names the rank and what happened."""
    server, pid = _two_rank_server(tiny_dir, tmp_path)
    stream = server.client.completions.create(model="tiny", prompt="hello", max_tokens=900, stream=True,
                                              extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    os.kill(pid, getattr(signal, how))
    try:
        code, _ = _ended(server, pid)
    finally:
        server.stop()
    assert code != 0
    event = {"SIGKILL": "rank_exited", "SIGSTOP": "rank_unresponsive"}[how]
    (failure,) = [line for line in server.logs() if line["event"] == event]
    assert failure["rank"] == 1 and failure["pid"] == pid and failure["level"] == "error"


def test_sigterm_stops_every_rank(tiny_dir, tmp_path, monkeypatch):
    """The ranks run with the engine's environment (NCCL_* included), and SIGTERM stops them all, exit 0."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    server, pid = _two_rank_server(tiny_dir, tmp_path, attention="tensor-parallel")
    assert b"NCCL_SOCKET_IFNAME=lo" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    answer = server.client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop")
    server.proc.send_signal(signal.SIGTERM)
    try:
        code, _ = _ended(server, pid)
    finally:
        server.stop()
    assert code == 0
    events = [line["event"] for line in server.logs()]
    assert "ranks_stopped" in events and "rank_exited" not in events
    assert json.loads(next(line for line in server.log_path.read_text().splitlines()
                           if '"ranks_stopped"' in line))["exit_codes"] == [0]  # fmt: skip
