"""Serving benchmark: start `python -m engine serve` (or use a running one with --url), drive it with streamed
/v1/completions requests of fixed input and output lengths at a fixed concurrency, and report TTFT, TPOT and
throughput, with the engine's /server_info and /metrics around it (the steps run and, per MoE layer, the mean distinct
routed experts a decode step read, from the engine's counters).

    python bench/serve.py --model /models/DeepSeek-V4-Flash --engine-args "--context-length 131072" \\
        --num-prompts 256 --concurrency 32 --input-len 4096 --output-len 512 --out bench/results/h200.json
    python bench/serve.py --smoke    # the tiny checkpoint on the CPU: a few seconds

Prompts are random token ids (exact input lengths, no tokenizer round trip) and `ignore_eos` makes every request
produce exactly --output-len tokens. Only httpx and the standard library are needed on the client side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BOOT_TIMEOUT_S = 3600  # a real checkpoint loads for minutes
SMOKE = {"num_prompts": 8, "concurrency": 4, "input_len": 64, "output_len": 16}
SMOKE_ENGINE_ARGS = "--dtype float32 --context-length 512 --max-num-seqs 4 --max-num-batched-tokens 256"


@dataclass
class RequestResult:
    input_len: int
    started_s: float = 0.0  # since the load's start: with ttft_s and chunk_gaps_s, when each token arrived
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def main() -> int:
    args = parse_args()
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
        args.engine_args = f"{SMOKE_ENGINE_ARGS} {args.engine_args}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke and not args.model and not args.url:
            from engine.tools.make_tiny import make_tiny

            args.model = str(make_tiny(Path(tmp) / "tiny"))
        engine = None if args.url else Engine(args.model, shlex.split(args.engine_args), Path(tmp) / "engine.log")
        url = args.url or engine.url
        try:
            report = asyncio.run(run(url, args))
        finally:
            if engine is not None:
                report_exit = engine.stop()
                print(f"engine exited with {report_exit}", file=sys.stderr)
    print_report(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["summary"]["failed"] else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory for the engine this harness starts")
    parser.add_argument("--url", help="benchmark an engine already running at this base URL instead")
    parser.add_argument("--engine-args", default="", help="extra `python -m engine serve` flags, one string")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report as JSON here (e.g. bench/results/NAME.json)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU, a few small requests")
    args = parser.parse_args()
    if not (args.model or args.url or args.smoke):
        parser.error("give --model, --url or --smoke")
    return args


class Engine:
    """`python -m engine serve` on a free loopback port, until stop()."""

    def __init__(self, model: str, extra: list[str], log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "engine", "serve", "--model", model, "--port", str(port), *extra]
        print("starting:", shlex.join(command), file=sys.stderr)
        self.log_path = log_path
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True, env=os.environ.copy()
        )
        started = time.monotonic()
        for line in self.proc.stdout:
            if line.startswith("engine ready:"):
                print(line.strip(), f"(after {time.monotonic() - started:.1f} s)", file=sys.stderr)
                return
            if time.monotonic() - started > BOOT_TIMEOUT_S:
                break
        self.proc.kill()
        raise RuntimeError(f"the engine did not become ready:\n{log_path.read_text()[-4000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def run(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as client:
        info = (await client.get("/server_info")).json()
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab = vocab_size(info)
        rng = random.Random(args.seed)
        ids = range(2, vocab)
        prompts = [rng.choices(ids, k=args.input_len) for _ in range(args.num_prompts)]  # 128K-token ones too, fast
        await one_request(client, model, prompts[0][:16], 2)  # warm-up
        metrics_before = parse_metrics((await client.get("/metrics")).text)
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                return await one_request(client, model, prompt, args.output_len, started)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - started
        metrics_after = parse_metrics((await client.get("/metrics")).text)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "smoke"} | {"smoke": args.smoke},
        "engine": {
            "build": info["build"],
            "config": info["config"],
            "kv_capacity_tokens": info["kv_capacity_tokens"],
            "gpu_memory": info["gpu_memory"],
        },
        "summary": summarize(results, duration, metrics_before, metrics_after),
        "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in results],
    }


def vocab_size(info: dict) -> int:
    """The checkpoint's vocabulary, when the engine's model directory is readable from here; else ids below 1000,
    which every vocabulary has."""
    try:
        return json.loads((Path(info["model"]) / "config.json").read_text())["vocab_size"]
    except (OSError, KeyError, ValueError):
        return 1000


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, load_started: float | None = None
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = last = time.perf_counter()
    result = RequestResult(input_len=len(prompt), started_s=0.0 if load_started is None else started - load_started)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    else:
                        result.chunk_gaps_s.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        result.error = repr(error)
    result.latency_s = time.perf_counter() - started
    return result


def parse_metrics(text: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    }


def experts_touched_per_step(before: dict, after: dict, kind: str = "decode") -> tuple[int, list[float] | None]:
    """Steps of `kind` between two scrapes, and per MoE layer the mean distinct routed experts such a step read
    (None without such steps, or from an engine that does not count them)."""
    name = f'flashgate_steps_total{{kind="{kind}"}}'
    steps = int(after.get(name, 0) - before.get(name, 0))
    per_layer, layer = [], 0
    while steps and (name := f'flashgate_moe_experts_touched_total{{kind="{kind}",layer="{layer}"}}') in after:
        per_layer.append((after[name] - before.get(name, 0)) / steps)
        layer += 1
    return steps, per_layer or None


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    decode_steps, decode_experts_touched = experts_touched_per_step(before, after)
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.input_len for r in ok)

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        ordered = sorted(values)
        return {
            "mean": statistics.fmean(ordered),
            "p50": ordered[len(ordered) // 2],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        }

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (output + prompt) / duration,
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "itl_s": stats([gap for r in ok for gap in r.chunk_gaps_s]),  # between streamed chunks
        "preemptions": after.get("flashgate_preemptions_total", 0) - before.get("flashgate_preemptions_total", 0),
        "decode_steps": decode_steps,
        "decode_experts_touched": decode_experts_touched,  # per MoE layer, the mean of a decode step
    }


def print_report(report: dict) -> None:
    s = report["summary"]
    args = report["args"]
    print(
        f"{s['completed']} requests ({s['failed']} failed) of {args['input_len']} in / {args['output_len']} out "
        f"at concurrency {args['concurrency']} in {s['duration_s']:.2f} s; build {report['engine']['build']}"
    )
    throughput = (
        f"{s['output_tokens_per_s']:.1f} output tok/s, {s['total_tokens_per_s']:.1f} total tok/s, "
        f"{s['requests_per_s']:.2f} req/s, {s['preemptions']:.0f} preemptions"
    )
    print("  throughput:", throughput)
    for name in ("ttft_s", "tpot_s", "itl_s"):
        values = s[name]
        if values:
            print(f"  {name[:-2].upper():4s} ms: " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in values.items()))
    for error in s["errors"]:
        print("  error:", error)


if __name__ == "__main__":
    sys.exit(main())
